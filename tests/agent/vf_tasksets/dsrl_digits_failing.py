"""dsrl_digits_taskset with a reward that raises on the tasks of odd idx (their episodes are not `ok`)."""
import verifiers.v1 as vf

from dsrl_digits_taskset import DigitsTask, digit_tasks


class FailingDigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        return digit_tasks(self.config, fail_odd=True)


__all__ = ["FailingDigitsTaskset"]
