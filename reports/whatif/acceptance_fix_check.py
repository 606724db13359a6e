"""Seeds 4 and 5 with draft acceptance evaluated at each entry's true position (reports/whatif.md,
"What the loop needs" 1). An in-process patch of `AcceptanceModel.emitted` for this check only;
the repository's simulator is unchanged. Run from the repository root:

    python reports/whatif/acceptance_fix_check.py   # writes reports/whatif/acceptance_fix_check.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sim.acceptance as acceptance  # noqa: E402
from core.config import load_config  # noqa: E402
from sim.run import simulate  # noqa: E402


def emitted_at_true_position(self, batch):  # type: ignore[no-untyped-def]
    """As AcceptanceModel.emitted, but a decode entry of a token-id trace is evaluated where its
    request really is: prompt + outputs applied so far (batches complete in order), not at the
    position the scheduler assumed when it launched the entry with a batch still in flight."""
    out = []
    for e in batch.entries:
        if not e.generates or e.num_drafts == 0:
            out.append(1)
            continue
        pos = e.start_pos
        if not e.is_prefill and self.token_ids is not None:
            pos = e.req.prompt_len + e.req.num_output_tokens - 1
        out.append(1 + self._accepted(e.req, pos, e.num_drafts))
    return out


def run(config: str, trace: str, sets: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        s = simulate(load_config(config, sets), trace, Path(tmp) / "run").summary
    return {
        "output_tok_per_s": s["output_tok_per_s"],
        "tpot_s.mean": s["tpot_s"]["mean"],
        "accepted_draft_tokens": s["accepted_draft_tokens"],
        "num_steps": s["num_steps"],
        "bubble_fraction": s["bubble_fraction"],
    }


def main() -> None:
    acceptance.AcceptanceModel.emitted = emitted_at_true_position  # type: ignore[method-assign]
    out: dict[str, dict[str, float]] = {}
    seed4 = "traces/seed4_ngram.parquet"
    for name, cfg in (("h100", "reports/whatif/seed4.toml"), ("h20", "reports/whatif/seed4_h20.toml")):
        for c in (2, 8, 16):
            for method in ("ngram-gpu", "ngram-cpu"):
                key = f"seed4/{name}/max_num_seqs={c}/spec.method={method}"
                out[key] = run(cfg, seed4, [f"max_num_seqs={c}", f"spec.method={method}"])
            gpu, cpu = (out[f"seed4/{name}/max_num_seqs={c}/spec.method={m}"] for m in ("ngram-gpu", "ngram-cpu"))
            print(f"seed4 {name} {c:>2} prompts: ngram-gpu vs ngram-cpu "
                  f"{100 * (gpu['output_tok_per_s'] / cpu['output_tok_per_s'] - 1):+.1f} % tok/s, "
                  f"accepted {gpu['accepted_draft_tokens']} vs {cpu['accepted_draft_tokens']}")
    for depth in (1, 2, 3):
        for opt in ("false", "true"):
            key = f"seed5/batches_in_flight={depth}/optimistic_spec_decode={opt}"
            r = out[key] = run("reports/whatif/seed5.toml", "traces/seed5_optimistic.parquet",
                               [f"batches_in_flight={depth}", f"optimistic_spec_decode={opt}"])
            print(f"seed5 depth {depth} optimistic={opt}: TPOT {1e3 * r['tpot_s.mean']:.3f} ms, "
                  f"accepted {r['accepted_draft_tokens']}, bubbles {100 * r['bubble_fraction']:.2f} %")
    path = Path("reports/whatif/acceptance_fix_check.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
