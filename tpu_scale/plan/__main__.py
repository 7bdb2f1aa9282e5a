"""`python -m tpu_scale.plan`: see `tpu_scale.plan.cli`."""

import sys

from tpu_scale.plan.cli import main

sys.exit(main())
