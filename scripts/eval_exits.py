"""Per-exit validation loss and top-1 agreement with the final layer: ``layerskip eval-exits`` as a script.

    python scripts/eval_exits.py --model default --config recipes/cpu-demo-stdlib.yaml --out runs/exits_base
    python scripts/eval_exits.py --model runs/cpu-demo/final --data gsm8k --out runs/exits_trained

Same options and code as ``layerskip eval-exits`` (layerskip_cli/commands/eval_exits.py).
"""

import sys

from layerskip_cli.commands.eval_exits import main

if __name__ == "__main__":
    sys.exit(main())
