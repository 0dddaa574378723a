from driverd.cli import main

raise SystemExit(main())
