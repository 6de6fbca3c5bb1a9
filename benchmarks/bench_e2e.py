"""End-to-end benchmark against stock PEFT; the same as ``peft-csgmv bench`` (see peft_csgmv/bench.py).

python benchmarks/bench_e2e.py --model 1b --out results/e2e_1b.json
"""

import sys

from peft_csgmv.bench import main

if __name__ == "__main__":
    sys.exit(main())
