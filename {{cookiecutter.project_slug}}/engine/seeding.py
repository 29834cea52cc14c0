"""Where randomness comes from, so that runs repeat exactly: model initialisation from
`seed` on every rank; dropout and other in-model randomness per (seed, rank, epoch), each
rank's state kept in step checkpoints for a mid-epoch resume; data augmentation per (seed,
epoch, sample index) right before the sample is made (loader.py), whatever the rank, worker
or world size."""

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
    """One seed per sample index from `derive_seed(seed, epoch)` by splitmix64 on whole arrays
    (an epoch costs less than a step); distinct indices give distinct seeds (a bijection)."""
    x = np.asarray(indices, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(epoch_seed)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))).tolist()  # uint64 arithmetic wraps, by design


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU) and Python's `random`."""
    torch.manual_seed(seed)
    random.seed(seed)


def capture_rng_state() -> dict:
    """This process's RNG states as plain numbers: no pickled tensors between ranks or in checkpoints."""
    cuda = {"cuda": torch.cuda.get_rng_state().tolist()} if torch.cuda.is_initialized() else {}
    return {"torch": torch.get_rng_state().tolist(), "python": random.getstate(), **cuda}


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]  # a checkpoint may give lists; setstate wants tuples
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


@contextlib.contextmanager
def borrowed_rng(cpu_generator_only: bool = False):
    """A block whose draws leave the RNGs a checkpoint holds (torch's CPU and GPU, Python's) as
    they were; `cpu_generator_only`: torch's CPU generator alone (1 us: fit for every batch). Yields it."""
    cpu = torch.default_generator
    save, restore = (cpu.get_state, cpu.set_state) if cpu_generator_only else (capture_rng_state, restore_rng_state)
    caller = save()
    try:
        yield cpu
    finally:
        restore(caller)


def set_determinism(enabled: bool, device: torch.device) -> None:
    """PyTorch's deterministic algorithms (slower on GPU; errors on ops that have none)."""
    if enabled and device.type == "cuda":
        # cuBLAS needs a fixed workspace to be deterministic; read when it starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)
