from graphcap.cli import main

raise SystemExit(main())
