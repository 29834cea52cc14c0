"""Where randomness comes from, so that runs repeat exactly.

- Model initialisation: the same `seed` on every rank (DDP also broadcasts rank 0's).
- Dropout and other in-model randomness: seeded per (seed, rank, epoch) at each epoch's
  start, and each rank's state is stored in step checkpoints for mid-epoch resume.
- Data augmentation: seeded per (seed, epoch, sample index) right before the sample is
  made (loader.py), so it does not depend on the rank, the worker or the world size.
"""

import contextlib
import hashlib
import os
import random

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers; nearby inputs give unrelated seeds."""
    text = "/".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def sample_seeds(epoch_seed: int, indices: list[int]) -> list[int]:
    """One seed per sample index from its epoch's `derive_seed(seed, epoch)`, by a
    splitmix64 step on whole arrays: a whole epoch costs less than one training step.
    Distinct indices give distinct 64-bit values (each step is a bijection)."""
    x = np.asarray(indices, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(epoch_seed)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))).tolist()  # uint64 arithmetic wraps, by design


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU) and Python's `random`."""
    torch.manual_seed(seed)
    random.seed(seed)


def capture_rng_state() -> dict:
    """This process's RNG states as plain numbers: they travel between ranks and into
    checkpoints without pickled tensors."""
    state = {"torch": torch.get_rng_state().tolist(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


@contextlib.contextmanager
def borrowed_rng(cpu_generator_only: bool = False):
    """A block whose random draws leave the caller's RNG as it was: every RNG a checkpoint
    holds (torch's CPU and GPU generators, Python's random), or with `cpu_generator_only`
    torch's CPU generator alone, which it yields (about 1 us: fit for every batch)."""
    if cpu_generator_only:
        generator = torch.default_generator
        caller = generator.get_state()
        try:
            yield generator
        finally:
            generator.set_state(caller)
        return
    caller = capture_rng_state()
    try:
        yield None
    finally:
        restore_rng_state(caller)


def to_tuples(value):
    """random.setstate wants the nested tuples it gave; a checkpoint may return lists."""
    if isinstance(value, (list, tuple)):
        return tuple(to_tuples(v) for v in value)
    return value


def set_determinism(enabled: bool, device: torch.device) -> None:
    """PyTorch's deterministic algorithms (slower on GPU; errors on ops that have none)."""
    if enabled and device.type == "cuda":
        # cuBLAS needs a fixed workspace to be deterministic; read when it starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)
