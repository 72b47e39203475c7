"""Quantities as flags give them, in tc(8)'s syntax: rates (``100mbit``, ``1gbit``),
times (``2ms``) and sizes (``64kb``), parsed with a refusal that names the flag; and a
rate's share that reaches TCP as payload. Pure, at the bottom: the cluster's links,
the device interconnects, the cost model and the commands read them alike.

    >>> parse_rate("1gbit"), parse_delay("2ms"), parse_size("64kb")
    (1000000000.0, 0.002, 65536)
"""

from __future__ import annotations

import re

from psring.errors import ConfigError

#: tc(8)'s rate units, in bits per second (tc compares them case-insensitively)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
               "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30,
               "tibps": 8 * 2**40}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3,
               "msecs": 1e-3, "us": 1e-6, "usec": 1e-6, "usecs": 1e-6}
#: tc(8)'s sizes, in bytes (its k and kb are 1024)
_SIZE_UNITS = {"b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)\s*"
#: slower links would make every run take minutes; faster ones only measure the CPU
MIN_RATE_BITS = 1e6


def _quantity(text: str, units: dict[str, float], refusal: str) -> float:
    """A number times its unit (tc's syntax, case-insensitive); ConfigError(``refusal``)
    when ``text`` is no such thing."""
    m = re.fullmatch(_NUMBER, text or "")
    unit = m.group(2).lower() if m else ""
    if not m or unit not in units:
        raise ConfigError(refusal)
    return float(m.group(1)) * units[unit]


def parse_rate(text: str, flag: str = "--link") -> float:
    """Bits per second of a tc rate (``100mbit``, ``1gbit``, ``1.5Gbit``, ``125mbps``)."""
    bits = _quantity(text, _RATE_UNITS, f"{flag} {text!r} is not a rate: give a number and "
                     f"one of tc's units, e.g. 100mbit, 1gbit, 10gbit (bit, kbit, mbit, "
                     f"gbit, tbit are bits per second; bps, kbps, mbps, gbps are bytes per "
                     f"second; kibit, mibit, ... are binary multiples).")
    if bits < MIN_RATE_BITS:
        raise ConfigError(f"{flag} {text!r} is {bits:g} bit/s; emulated links start at "
                          f"1mbit (slower ones make a step take minutes).")
    return bits


def parse_delay(text: str, flag: str = "--delay") -> float:
    """Seconds of a tc time (``100us``, ``2ms``, ``0.5ms``)."""
    return _quantity(text, _TIME_UNITS, f"{flag} {text!r} is not a time: give a number and "
                     f"a unit, e.g. 100us, 2ms (s, ms, us).")


def parse_size(text: str, flag: str = "--link-buffer") -> int:
    """Bytes of a tc size (``64kb``, ``1mb``, ``1500b``)."""
    size = int(_quantity(text, _SIZE_UNITS, f"{flag} {text!r} is not a size: give a number "
                         f"and one of tc's units, e.g. 64kb, 512kb, 1mb (b, kb, mb; "
                         f"k = 1024)."))
    if size < 3000:
        raise ConfigError(f"{flag} {text!r} is {size} bytes; a link's queue holds at least "
                          f"two full-size frames (3000 bytes).")
    return size


def parse_window(text: str, flag: str = "--credit-window") -> int:
    """Bytes of a credit window (tc's sizes, or a bare number of bytes): at least one
    full datagram on the wire."""
    bare = text.strip()
    size = int(bare) if bare.isdigit() else int(_quantity(
        text, _SIZE_UNITS, f"{flag} {text!r} is not a size: give a number and one of tc's "
        f"units, e.g. 64kb (b, kb, mb; k = 1024)."))
    if size < 1514:
        raise ConfigError(f"{flag} {text!r} is {size} bytes: a credit window lets at least "
                          f"one datagram (1514 bytes on the wire) be in flight to a server; "
                          f"give e.g. 64kb, or drop {flag} for senders that pace themselves.")
    return size


def format_rate(bits: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


#: the share of a shaped link's rate that reaches TCP as payload: tbf counts each
#: frame's bytes (Ethernet header included: 1514 per 1500-byte MTU), of which 1448 are
#: payload (IPv4 20, TCP 20 + 12 of timestamps)
PAYLOAD_FRACTION = 1448 / 1514


def payload_beta(bits: float) -> float:
    """Seconds per payload byte over a link of ``bits``/s: the cost model's nominal β."""
    return 8 / (bits * PAYLOAD_FRACTION)
