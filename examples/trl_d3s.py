"""A real TRL `GRPOTrainer` run with rollstore recording and D3S curation, on CPU.

    OMP_NUM_THREADS=1 python examples/trl_d3s.py [--steps 20] [--buffer DIR] [--model builtin:tiny|DIR]

The policy is rollstore's built-in tiny model (`builtin:tiny`: a 2-layer character-level Llama
warm-started on the `builtin:arith` additions; built and cached under ~/.cache/rollstore on first
use, about a minute), the prompts are `builtin:arith` training prompts, and the reward is exact
match of the completion with the sum. Each optimiser step TRL samples one generation batch; the
plug-in (`rollstore.trl.RollstoreGRPOTrainer`) records every completion into the buffer, runs the
`d3s` recipe over that batch and trains on what it selected. At the end it prints the TRL version,
the rows recorded, the rows trained, the audit's reason counts (from the `selections` table) and
the wall time. Needs the `trl` extra: `pip install -e '.[trl]'`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def accuracy(completions, answer, **kw):
    """1.0 when the completion is exactly the sum (the tiny model answers digits, then EOS)."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


accuracy.rollstore_correct = True  # this reward function decides `correct`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="optimiser steps (one generation batch each)")
    ap.add_argument("--buffer", default=None, help="buffer directory (default: a fresh temporary one)")
    ap.add_argument("--model", default="builtin:tiny", help="builtin:tiny or a local transformers model directory")
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import duckdb
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from rollstore.rollout.arith import train_prompts
    from rollstore.builtin.resolve import resolve_model
    from rollstore.trl import RollstoreGRPOTrainer
    from rollstore.storage.buffer import Buffer

    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    t_model = time.perf_counter()
    buf_dir = args.buffer or tempfile.mkdtemp(prefix="rollstore-trl-d3s-")
    run_id = f"trl-d3s-seed{args.seed}"

    prompts = train_prompts(args.prompts_per_step * args.steps, seed=args.seed)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.gold_answer} for p in prompts])
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = GRPOConfig(
        output_dir=os.path.join(buf_dir, "..", os.path.basename(buf_dir) + "-trl-out"),
        num_generations=args.group_size, per_device_train_batch_size=args.prompts_per_step * args.group_size,
        max_completion_length=6, max_steps=args.steps, learning_rate=5e-5, temperature=1.0,
        logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = RollstoreGRPOTrainer(model=model, reward_funcs=[accuracy], args=config, train_dataset=dataset,
                                   processing_class=tok, buffer=buf_dir, run_id=run_id, curate="d3s")
    t_train = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()

    with Buffer.open(buf_dir) as buf, buf.snapshot() as snap:
        con = duckdb.connect()
        snap.register_duckdb(con, ["rollouts", "selections", "curated"])
        con.execute("CREATE TEMP TABLE ours AS SELECT rollout_id FROM rollouts WHERE run_id = ?", [run_id])
        recorded, tokens, acc = con.execute(
            "SELECT count(*), sum(len(response_token_ids)), avg(correct::INT) FROM rollouts WHERE run_id = ?", [run_id]).fetchone()
        trained, kept_tokens = con.execute(
            "SELECT count(*), sum(len(list_filter(loss_mask, lambda k: k))) FROM curated SEMI JOIN ours USING (rollout_id)").fetchone()
        reasons = con.execute("SELECT reason, count(*) AS n FROM selections SEMI JOIN ours USING (rollout_id) "
                              "GROUP BY reason ORDER BY n DESC, reason").fetchall()
        curations = con.execute("SELECT count(DISTINCT curation_id) FROM selections SEMI JOIN ours USING (rollout_id)").fetchone()[0]
    first = [h["reward"] for h in trainer.state.log_history if "reward" in h]

    print(f"TRL version:        {trl.__version__}")
    print(f"model:              {args.model} ({model_dir})")
    print(f"optimiser steps:    {trainer.state.global_step} ({args.prompts_per_step} prompts x {args.group_size} completions per step, curate='d3s', {curations} curations)")
    print(f"rows recorded:      {recorded} ({tokens} response tokens; accuracy {acc:.3f})")
    print(f"rows trained:       {trained} ({kept_tokens} tokens in the loss)")
    print("audit reasons:      " + ", ".join(f"{r} {n}" for r, n in reasons))
    if first:
        print(f"mean reward logged: first {first[0]:.3f}, last {first[-1]:.3f} "
              f"(TRL's mean over each window of {config.logging_steps} steps)")
    print(f"wall time:          {t_end - t0:.1f} s total; {t_end - t_train:.1f} s in trainer.train() "
          f"(imports and model resolve {t_model - t0:.1f} s)")
    print(f"buffer:             {buf_dir}  (try: rollstore audit {buf_dir})")


if __name__ == "__main__":
    main()
