from ratchetlm.cli import main

raise SystemExit(main())
