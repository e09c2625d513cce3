"""Write the calculator demo's demonstrations (examples/tools/calculator_demonstrations.jsonl).

Each is one conversation of the tool environment in the plain format (megatron_gspo/env/calls.py): the
product asked, the call that computes it, the tool's answer, the answer given. The problems come from the
built-in arithmetic task under its own seed (never the training run's examples):

    python examples/tools/make_demonstrations.py [N]
"""

import json
import os
import sys

from megatron_gspo.data.tasks import build_task
from megatron_gspo.env.calculator import calculator
from megatron_gspo.env.calls import format_call

SEED = 99  # the training data uses data.seed=1234


def main(n: int = 128) -> None:
    task = build_task("arithmetic", seed=SEED, num_digits=3, operators="*")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calculator_demonstrations.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for i in range(n):
            ex = task[i]
            expression = ex["prompt"].rstrip("=")
            result = calculator(expression)
            assert result == ex["answer"], (ex, result)
            messages = [{"role": "user", "content": ex["prompt"]},
                        {"role": "assistant", "content": format_call("calculator", {"expression": expression}, "plain",
                                                                     single="expression")},
                        {"role": "tool", "content": result},
                        {"role": "assistant", "content": ex["answer"]}]
            f.write(json.dumps({"id": ex["id"], "messages": messages}) + "\n")
    print(f"wrote {n} demonstrations to {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128)
