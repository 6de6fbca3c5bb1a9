"""End-to-end benchmark against stock PEFT; the same as ``peft-csgmv bench`` (see peft_csgmv/bench.py).

python benchmarks/bench_e2e.py --model 1b --out results/e2e_1b.json
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from peft_csgmv.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
