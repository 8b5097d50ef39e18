"""An offline verifiers 0.4 taskset for dsrl's tests (imported by the verifiers venv's interpreter, with
this folder's parent on PYTHONPATH): eight in-memory tasks "Reply with the digit N.", one reward (1.0
when the reply contains the digit, else 0.0). `dsrl_digits_failing` is the same taskset with a
reward that raises on the tasks of odd idx, so their episodes are not `ok`.
"""
from __future__ import annotations

import verifiers.v1 as vf

DIGITS = [3, 5, 1, 8, 2, 9, 4, 7]


class DigitsData(vf.TaskData):
    digit: int = 0
    fail: bool = False


class DigitsTask(vf.Task[DigitsData]):
    @vf.reward(weight=1.0)
    async def says_the_digit(self, trace: vf.Trace) -> float:
        if self.data.fail:
            raise RuntimeError(f"the reward of the task for digit {self.data.digit} raises (on purpose)")
        return 1.0 if str(self.data.digit) in trace.last_reply else 0.0


def digit_tasks(config, fail_odd: bool):
    for i, d in enumerate(DIGITS):
        yield DigitsTask(DigitsData(prompt=f"Reply with the digit {d}.", digit=d, name=f"digit-{d}",
                                    fail=fail_odd and i % 2 == 1), config.task)


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        return digit_tasks(self.config, fail_odd=False)


__all__ = ["DigitsTaskset"]
