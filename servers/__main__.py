from psring.servers.entry import main

raise SystemExit(main())
