"""A deterministic, checkpointable prompt sampler over epochs.

Each epoch is a permutation of the dataset drawn from ``seed + epoch`` (or the identity when
``shuffle`` is off). The state is just ``(epoch, position)``, so a run resumed from a checkpoint
continues with the very next prompt. A batch that reaches the end of an epoch is completed from the
start of the next epoch: no prompt is skipped and none is repeated within an epoch (the usual
``drop_last`` loss of a dataloader does not happen).
"""

from __future__ import annotations

import numpy as np


class EpochSampler:
    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_items < 1:
            raise ValueError("the dataset is empty; check data.train_files")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            else:
                self._order = np.arange(self.num_items)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_batch(self) -> list[int]:
        """Dataset indices of the next batch; advances the state."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), self.num_items - self.position)
            batch.extend(int(i) for i in order[self.position:self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_items"] != self.num_items:
            raise ValueError(
                f"sampler state was saved for {state['num_items']} prompts but the dataset now has "
                f"{self.num_items}; resume with the same data files and data.max_prompt_tokens"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state was saved with seed {state['seed']}, config says {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
