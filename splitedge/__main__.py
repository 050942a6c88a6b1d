from splitedge.cli import main

raise SystemExit(main())
