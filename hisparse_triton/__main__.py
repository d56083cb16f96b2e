"""``python -m hisparse_triton``: the same CLI as the ``hisparse-triton`` script."""

from hisparse_triton.cli import main

raise SystemExit(main())
