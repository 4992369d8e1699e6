from multiplexer.cli import main

raise SystemExit(main())
