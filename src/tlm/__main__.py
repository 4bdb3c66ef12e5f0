from tlm.cli import main

raise SystemExit(main())
