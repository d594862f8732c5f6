from skylift.cli.main import main

raise SystemExit(main())
