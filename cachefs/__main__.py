from cachefs.service.cli import main

raise SystemExit(main())
