"""How many draft tokens a step verifies. Priced after the step's decodes and prompt chunks are
placed, so drafts only spend what the budget leaves: a request's j-th draft token is expected
kept with probability a^j (spec_decode/drafts.py), and it joins the step if that expected token
costs no more time, by the step-time model, than a token of the step's plain decodes does. At
c=1 a step is mostly a pass over the weights and drafts are cheap; in a full batch a token costs
its own compute and only drafts nearly sure to be kept pay, so speculation shrinks as the batch
grows instead of slowing it. A drafting row is priced as the one-token decodes it runs as."""

from __future__ import annotations

from dataclasses import dataclass

from replica_engine.request import Request
from replica_engine.scheduler.step_time_model import StepShape, StepTime
from replica_engine.spec_decode.drafts import acceptance


@dataclass(frozen=True)
class DraftPricing:
    """One step's prices: its shape so far (decodes and prompt chunks placed) and its predicted
    time, the time of a token of its plain decodes, and the TBT target's share drafts may not
    overrun (None: no target)."""

    step_time: StepTime | None
    step: StepShape
    seconds: float
    seconds_per_token: float
    target_s: float | None = None

    @classmethod
    def of(
        cls, decodes: StepShape, step: StepShape, step_time: StepTime | None, target_s: float | None = None
    ) -> DraftPricing:
        per_token = (
            step_time.predict(decodes) / decodes.num_decodes if step_time and decodes.num_decodes else 0.0
        )
        seconds = step_time.predict(step) if step_time is not None else 0.0
        return cls(step_time, step, seconds, per_token, target_s)

    def may_pay(self, request: Request) -> bool:
        """Whether the request's first draft token could pay for itself: asked before proposing,
        which costs host time too (the batch's decodes each, every step)."""
        if self.step_time is None:
            return True
        one_more = self.step.plus(request.num_planned_tokens + 1, 1, is_decode=True)
        extra = self.step_time.predict(one_more) - self.seconds
        return extra <= acceptance(request) * self.seconds_per_token

    def take(self, proposals: dict[Request, list[int]], budget: int) -> dict[Request, int]:
        """How many of each proposal's leading tokens the step verifies, within `budget` tokens:
        likeliest first, while an expected token costs at most a plain decode's token and the
        step stays within the target. Without a step-time model, the budget alone decides."""
        candidates = sorted(
            (
                (acceptance(request) ** j, j, request)
                for request, tokens in proposals.items()
                for j in range(1, len(tokens) + 1)
            ),
            key=lambda candidate: (-candidate[0], candidate[1]),
        )
        taken = dict.fromkeys(proposals, 0)
        step_time, step, seconds = self.step_time, self.step, self.seconds
        for chance, j, request in candidates:
            if budget == 0:
                break
            if taken[request] != j - 1:  # its earlier token did not pay: neither does this one
                continue
            longer = step.plus(request.num_planned_tokens + j, 1, is_decode=True)
            if step_time is not None:
                extra = step_time.predict(longer) - seconds
                over = self.target_s is not None and seconds + extra > self.target_s
                if over or extra > chance * self.seconds_per_token:
                    break
                seconds += extra
            step, budget, taken[request] = longer, budget - 1, j
        return {request: n for request, n in taken.items() if n}
