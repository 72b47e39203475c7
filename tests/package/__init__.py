"""The repository and its wheel as shipped: layout rules, build, install and run."""
