"""`python -m scheduler_svc.cli ...` is `batchwire ...`."""

import sys

from scheduler_svc.cli.commands import main

sys.exit(main())
