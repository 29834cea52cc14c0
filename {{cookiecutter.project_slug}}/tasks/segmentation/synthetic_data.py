"""The example's synthetic data (data.name=synthetic, the default): shapes and their masks
made from the seed, so the project trains with no download. Once you train on your own
data, delete this file, and its import and the synthetic branch in data.py's build_datasets.
"""

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors

from engine import derive_seed


class SyntheticShapes(Dataset):
    """Rectangles and ellipses of each foreground class on a noisy background, made from
    the seed alone: no download, the same on every rank. Each class has its own colour
    and the background its own texture, so a small network learns it in minutes.

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
        mask = torch.zeros(size, size, dtype=torch.uint8)
        ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            cls = int(torch.randint(1, self.num_classes, (), generator=g))
            cy, cx = torch.randint(size, (2,), generator=g).tolist()
            h, w = torch.randint(max(1, size // 8), max(2, size // 3), (2,), generator=g).tolist()
            if torch.rand((), generator=g) < 0.5:
                inside = ((ys - cy).abs() <= h) & ((xs - cx).abs() <= w)
            else:
                inside = ((ys - cy) / h) ** 2 + ((xs - cx) / w) ** 2 <= 1
            mask[inside] = cls
        image = self.colours[mask.long()].permute(2, 0, 1)  # each pixel its class's colour
        image = image + 0.25 * torch.randn(image.shape, generator=g)
        image = image.clamp_(0, 1).mul_(255).add_(0.5).to(torch.uint8)  # 8 bits, as image files
        image, mask = self.transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor).long()


# A tag in derive_seed's parts: synthetic samples' generators never share a seed with
# the run's other streams (model init, dropout, augmentation), which use fewer parts.
SYNTHETIC_STREAM = 0x5EED
