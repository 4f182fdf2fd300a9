from bench_routers.cli import main

raise SystemExit(main())
