from simdist.report.page import main

raise SystemExit(main())
