"""What a draft that caught up on the target's push (not on the gateway's next call) would take off a round.

    python push_catch_up.py TIMELINE_JSON...     # bench/round_timeline.py --json files

After a verify the draft catches up on the accepted tokens when the gateway's next Draft call arrives; the
target's pushed features reached the draft's store long before that. Both paths start at the target's reply
(the `target.reply` mark):
- the gateway's: the reply, the gateway's update, record, schedule and budgets, the call's message, the draft's
  parse, up to `draft.engine.start`;
- the push's: gRPC resuming the target's handler, the push, the draft storing it.
A catch-up started when the push is stored ends at push + catch-up; the tree's growth then starts at the later of
that and the call's arrival. The round shortens by min(catch-up, gateway path - push path), if positive.
"""

from __future__ import annotations

import json
import sys

GATEWAY_PATH = ["target.reply", "gw.step.reply", "gw.execute.end", "gw.update.end", "gw.record.end", "gw.round",
                "gw.draft.submit", "gw.draft.send", "draft.recv", "draft.features.start"]
PUSH_PATH = ["target.reply->target.sent", "target.sent->draft.push.recv", "draft.push.recv->draft.push.stored"]
CATCH_UP = "draft.engine.start->draft.catchup.end"


def main(paths: list[str]) -> None:
    print("timeline | rounds | round us | gateway path | push path | catch-up | saved | round after | saved %")
    for path in paths:
        data = json.load(open(path))
        gaps = {gap["gap"]: gap["median_us"] for gap in data["gaps"]}
        gateway = sum(gaps[name] for name in GATEWAY_PATH)
        push = sum(gaps[name] for name in PUSH_PATH)
        catch_up = gaps[CATCH_UP]
        whole = gaps["round"]
        saved = max(0.0, min(catch_up, gateway - push))
        print(f"{path} | {data['spec_rounds']} | {whole:.0f} | {gateway:.0f} | {push:.0f} | {catch_up:.0f} | "
              f"{saved:.0f} | {whole - saved:.0f} | {100 * saved / whole:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
