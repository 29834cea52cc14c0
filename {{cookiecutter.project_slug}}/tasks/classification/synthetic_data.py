"""The example's synthetic data (data.name=synthetic, the default): class images made
from the seed, so the project trains with no download. Once you train on your own data,
delete this file, and its import and the synthetic branch in data.py's build_datasets.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from engine import derive_seed


class SyntheticImages(Dataset):
    """A learnable image task made from the seed alone: no download, same on every rank.

    All classes share one smooth background; each adds its own mark at the centre, a
    smooth pattern MARK_SIZE pixels square, unlike every other class's. Classes 0-2 have
    a clear mark, the others a faint one. Background and marks are mirror-symmetric like
    most real classes (so flip augmentation keeps the label). A sample is its class image
    with a random brightness and a little pixel noise. In a 32x32 image the mark is a
    small part, which training's random crops move around: the demo's mlp is at val_acc
    about 0.3 after its first epoch (the clear classes) and above 0.9 after its fifth. In
    images of MARK_SIZE or smaller (8x8 in the tests) a mark fills the image: quick to learn.

    A sample is made when it is read, from its own generator seeded by (seed, split,
    index): the set's size costs no memory (data.train_size=10**9 fits as well as 4096),
    and a larger set begins with the same samples as a smaller one.
    """

    def __init__(self, size, num_classes, image_size, seed, split, transform=None):
        self.size = size
        self.patterns = class_patterns(num_classes, image_size, torch.Generator().manual_seed(seed))
        self.seed, self.split_id = seed, int(split == "val")
        self.transform = transform
        self.classes = [f"class_{i}" for i in range(num_classes)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if not 0 <= index < self.size:  # any index could be made: keep `for x in dataset` finite
            raise IndexError(f"sample {index} of {self.size}")
        g = torch.Generator().manual_seed(derive_seed(self.seed, SYNTHETIC_STREAM, self.split_id, index))
        label = int(torch.randint(len(self.patterns), (), generator=g))
        brightness = 0.6 + 0.8 * torch.rand((), generator=g)
        noise = 0.05 * torch.randn(self.patterns.shape[1:], generator=g)
        image = (self.patterns[label] - 0.5) * brightness + 0.5 + noise
        image = image.clamp_(0, 1).mul_(255).add_(0.5).to(torch.uint8).float().div_(255)  # 8 bits, as image files
        if self.transform is not None:
            image = self.transform(image)
        return image, label


# A tag in derive_seed's parts: synthetic samples' generators never share a seed with
# the run's other streams (model init, dropout, augmentation), which use fewer parts.
SYNTHETIC_STREAM = 0x5EED


MARK_SIZE = 10  # pixels: a small part of a 32x32 image, all of an 8x8 one
CLEAR_CLASSES = 3  # classes 0-2 have a clear mark, the others a faint one
CLEAR_MARK, FAINT_MARK = 0.22, 0.115  # root mean square change a mark makes to the background
BACKGROUND = 0.1  # root mean square of the background around its mean


def class_patterns(num_classes: int, image_size: int, generator: torch.Generator) -> torch.Tensor:
    """[num_classes, 3, image_size, image_size], values about 0 to 1: a soft background that
    all classes share plus each class's mark at the centre."""
    background = smooth_patterns(1, image_size, generator)
    background = 0.5 + BACKGROUND * (background - background.mean()) / background.std()  # as strong for any seed
    mark_size = min(MARK_SIZE, image_size)
    mark_size -= (image_size - mark_size) % 2  # the same margin on both sides keeps the symmetry
    contrast = torch.full((num_classes, 1, 1, 1), FAINT_MARK)
    contrast[:CLEAR_CLASSES] = CLEAR_MARK
    patterns = background.repeat(num_classes, 1, 1, 1)
    centre = slice((image_size - mark_size) // 2, (image_size + mark_size) // 2)
    patterns[:, :, centre, centre] += contrast * distinct_patterns(num_classes, mark_size, generator)
    return patterns


def smooth_patterns(num_classes: int, image_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random smooth mirror-symmetric patterns, values 0 to 1."""
    return mirrored_and_smoothed(torch.rand(num_classes, 3, 4, 2, generator=generator), image_size)


def distinct_patterns(num_classes: int, image_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random smooth mirror-symmetric patterns of root mean square 1 on their coarse grid,
    orthogonal to each other there (when they fit: up to 24), so that no two classes
    happen to look alike."""
    half = torch.randn(num_classes, 3 * 4 * 2, generator=generator)
    if num_classes <= half.shape[1]:
        half = torch.linalg.qr(half.T).Q.T
    half = half / half.square().mean(dim=1, keepdim=True).sqrt()
    return mirrored_and_smoothed(half.view(num_classes, 3, 4, 2), image_size)


def mirrored_and_smoothed(half: torch.Tensor, image_size: int) -> torch.Tensor:
    coarse = torch.cat([half, half.flip(-1)], dim=-1)  # mirror-symmetric: a flipped image keeps its class
    return F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
