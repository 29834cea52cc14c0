"""The example's synthetic data (data.name=synthetic, the default): shapes and their boxes
made from the seed, so the project trains with no download. Once you train on your own
data, delete this file and the synthetic branch in data.py's build_datasets.
"""

import torch
from torch.utils.data import Dataset

from data import make_sample
from engine import derive_seed


class SyntheticObjects(Dataset):
    """1 to 4 non-overlapping rectangles and ellipses of the foreground classes on a noisy
    background, made from the seed alone: no download, the same on every rank. Each
    class has its own colour, so a small detector learns it in minutes.

    A sample is made when it is read, from its own generator seeded by (seed, split,
    index): the set's size costs no memory, and a larger set begins with the same
    samples as a smaller one."""

    def __init__(self, size, num_classes, image_size, seed, split, transform):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size
        self.colours = torch.rand(num_classes, 3, generator=torch.Generator().manual_seed(seed))
        self.seed, self.split_id = seed, int(split == "val")
        self.transform = transform

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if not 0 <= index < self.size:  # any index could be made: keep `for x in dataset` finite
            raise IndexError(f"sample {index} of {self.size}")
        g = torch.Generator().manual_seed(derive_seed(self.seed, SYNTHETIC_STREAM, self.split_id, index))
        size = self.image_size
        canvas = torch.zeros(size, size, dtype=torch.long)  # each pixel's class
        boxes, labels = [], []
        for _ in range(int(torch.randint(1, 5, (), generator=g))):
            w, h = torch.randint(size // 6, size // 2, (2,), generator=g).tolist()
            x1 = int(torch.randint(size - w, (), generator=g))
            y1 = int(torch.randint(size - h, (), generator=g))
            box = (x1, y1, x1 + w, y1 + h)
            if any(overlap(box, other) for other in boxes):
                continue
            cls = int(torch.randint(1, self.num_classes, (), generator=g))
            draw_shape(canvas[y1 : y1 + h, x1 : x1 + w], cls, ellipse=bool(torch.rand((), generator=g) < 0.5))
            boxes.append(box)
            labels.append(cls)
        image = self.colours[canvas].permute(2, 0, 1)
        image = image + 0.25 * torch.randn(image.shape, generator=g)
        image = image.clamp_(0, 1).mul_(255).add_(0.5).to(torch.uint8)  # 8 bits, as image files
        boxes = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        return make_sample(image, boxes, torch.tensor(labels, dtype=torch.int64), self.transform)


# A tag in derive_seed's parts: synthetic samples' generators never share a seed with
# the run's other streams (model init, dropout, augmentation), which use fewer parts.
SYNTHETIC_STREAM = 0x5EED


def draw_shape(window: torch.Tensor, cls: int, ellipse: bool) -> None:
    """Fill `window` (a box of the canvas) with a rectangle or the ellipse inside it."""
    if not ellipse:
        window.fill_(cls)
        return
    h, w = window.shape
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    window[((2 * xs + 1 - w) / w) ** 2 + ((2 * ys + 1 - h) / h) ** 2 <= 1] = cls


def overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
