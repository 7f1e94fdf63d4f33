"""The packed learner against whole rows: learner positions and trainer seconds on long answers.

Rows: a 10-token prompt and a 40-token response whose loss mask ends early (the last kept token
uniform over the response, 30 % of the tokens before it kept) or, one row in five, keeps nothing —
the shape token selection gives a long answer. The same rows are trained with `TrainConfig(pack=False)`
(every row whole, the learner before packing) and packed, from the same initial weights, on a
random Llama of the given width; both must end at the same loss (printed). Seconds are wall time on
this machine, one torch thread; run with nothing else on the cores to compare them.

    OMP_NUM_THREADS=1 python -m bench.learner_packing [--hidden 256 --layers 4 --rows 512 --repeat 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))


def rows(n: int, seed: int = 0, prompt: int = 10, response: int = 40):
    import numpy as np
    import pyarrow as pa

    from rollstore.storage.schema import CURATED

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        end = int(rng.integers(1, response + 1))
        mask = [bool(t < end and rng.random() < 0.3) or t == end - 1 for t in range(response)]
        out.append({"curation_id": "c", "rollout_id": f"r{i}", "group_id": f"g{i // 8}", "prompt_id": f"p{i // 8}",
                    "policy_version": 0, "prompt_token_ids": [1] + rng.integers(3, 32, prompt - 1).tolist(),
                    "response_token_ids": rng.integers(3, 32, response).tolist(),
                    "old_logprobs": [-3.4] * response, "gen_logprobs": [-3.4] * response,
                    "advantage": float(rng.normal()), "loss_mask": [False] * response if i % 5 == 4 else mask,
                    "weight": 1.0})
    return pa.Table.from_pylist(out, schema=CURATED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollstore.learner.batches import iter_rank_steps, read_curated
    from rollstore.learner.config import TrainConfig
    from rollstore.learner.trainer import make_optimizer, train_on_curation
    from rollstore.storage.buffer import Buffer, Part

    torch.set_num_threads(1)
    root = os.path.join(tempfile.mkdtemp(prefix="rollstore-packing-"), "buf")
    Buffer.init(root).close()
    with Buffer.open(root) as buf:
        _, shards = buf.commit([Part("curated", rows(args.rows), key="c", subdir="c", name="part-00000")], "curate",
                               {"curation_id": "c"})
    paths = [os.path.join(root, s.path) for s in shards]
    config = LlamaConfig(vocab_size=32, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                         max_position_embeddings=64, pad_token_id=0)
    table = read_curated(paths)
    for pack in (False, True):
        n = [len(s.micro) for s in iter_rank_steps(table, args.micro_batch, 2, pack=pack)]
        print(f"pack={pack}: micro-batches per step {n}")
    for rep in range(args.repeat):
        for pack in (False, True):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            opt, sched = make_optimizer(model, lr=1e-4)
            t0 = time.perf_counter()
            out = train_on_curation(model, opt, sched, paths, TrainConfig(micro_batch_size=args.micro_batch,
                                                                          grad_accum=2, epochs=2, pack=pack))
            print(f"repeat {rep}, pack={pack}: {len(out)} steps, learner positions "
                  f"{sum(r['positions'] for r in out):,}, kept tokens {sum(r['tokens'] for r in out):,}, "
                  f"{time.perf_counter() - t0:.2f} s, last loss {out[-1]['loss']:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
