from memfit.cli import main

raise SystemExit(main())
