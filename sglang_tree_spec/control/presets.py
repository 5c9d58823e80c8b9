"""The shipped auto values of budget control, in one table.

``ControlConfig``'s defaults read :data:`AUTO`; why each value: ``benchmarks/README.md``,
"Tuned settings" (one row per key, with its evidence file and verdict).
"""

from __future__ import annotations

from types import MappingProxyType

AUTO = MappingProxyType(
    {
        "probe_every": 4,  # a plain run re-forecasts after this many steps ...
        "probe_max_every": 64,  # ... the interval doubling up to this while drafting does not pay
        "plain_decay": 0.95,  # the recent average of what drafted steps commit per plain forward
        "plain_long_decay": 0.995,  # ~200 drafted steps: a run starts only when neither pays
        "hard_plain_steps": 1,  # plain steps after a hard forecast while drafting pays
        "profile_steps": 3,  # times per cell of the start-up profile
        "explore_every": 32,  # drafted steps from one exploration to the next
        "explore_steps": 3,  # an exploration's budget holds this many steps: three fresh times
        "explore_margin": 0.08,  # explorations re-measure budgets within this of the best's rate
        "explore_inverted": 0.10,  # a cell dearer than a larger budget's by this is re-measured
        "explore_stale_neighbours": True,  # the best's neighbours unmeasured a while: contenders
        "forget_after": 512,  # drafted steps after which a cell's next time drops its old cost
        "hold_steps": 8,  # drafted steps a forecast's choice holds: pays for its extra ops
        "hold_max_steps": 32,  # a repeated choice holds twice as long, up to this
        "tie_rtol": 0.01,  # a larger budget must beat the best smaller one's rate by this
        "choice_decay": 0.5,  # the choice reads each request's decayed average of its forecasts
        "held_observe_every": 8,  # calibrate on one drafted step in this many
    }
)

# Target forwards of a plain step (budget 0), each committing one token a request: the
# scheduler's per-step work is paid once per this many tokens (SGLang reserves 2 x (budget + 1)
# >= 4 KV slots per request and step, so two forwards always fit).
PLAIN_FORWARDS = 2
