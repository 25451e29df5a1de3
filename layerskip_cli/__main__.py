"""``python -m layerskip_cli ...`` = ``layerskip ...``."""

import sys

from layerskip_cli.main import main

sys.exit(main())
