"""The task: edit this file to train your own model, loss and metrics.

What train.py and evaluate.py use from here:
- `ModelConfig`: the `model:` section of config.yaml, each key with its default.
- `build_model(cfg) -> nn.Module`: a plain module, unaware of distribution: the
  machinery converts BatchNorm to SyncBatchNorm, moves it to the device and wraps it
  in DDP, or FSDP (the fsdp part). Under FSDP, ranks other than 0 build it on the meta device (no memory)
  and receive rank 0's weights: it may create tensors but not read their values.
- `training_step(model, batch, cfg) -> loss`: the loss of one batch (a tensor), or a dict
  of named losses: backward runs on their sum, and each is logged as `train_<name>`.
  `cfg` is the run's config (e.g. cfg.model.<your setting>): keep settings and helper
  objects there or in this module, not as attributes of the model, where a module (a
  torchvision transform is one) would become part of the model.
- `build_metrics(cfg) -> {name: metric}` and `validation_step(model, batch, metrics, cfg)`:
  the validation metrics (engine.metrics: `Mean`, `Sum`, or `Gathered`), updated batch by
  batch; each is reported as `val_<name>`, exact over the whole validation set on any
  number of processes.
- `predict_step(model, batch) -> [result, ...]` (for predict.py): one result per input of
  a batch from data.py's `build_predict_set`, each a dict that JSON can write.
- `BLOCKS`: the repeated blocks of the model, the units that train.activation_checkpointing
  recomputes, and that FSDP shards (the fsdp part).

No `model_inputs`, so export.py --program refuses: torch.export cannot trace torchvision's
detectors, whose number of boxes depends on the data.

A batch is (list of images [3, H, W], list of target dicts) from data.py, already on the
device. Both steps run under autocast when train.precision is bf16 or fp16.
"""

import contextlib
import io
from dataclasses import dataclass
from typing import ClassVar

import torch.nn as nn
from torchvision.models import resnet18
from torchvision.models.detection import FCOS
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.resnet import BasicBlock
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from engine import ConfigError, Gathered, UsageError, check_positive


@dataclass
class ModelConfig:
    name: str = "fcos_resnet18_fpn"  # torchvision's FCOS on a ResNet-18 FPN, from scratch
    min_size: int = 128  # the detector resizes each image so its shorter side is min_size ...
    max_size: int = 128  # ... and its longer side at most max_size (COCO-sized images: 800 and 1333)

    # The resize is preprocessing: a resumed run may change it (e.g. to train larger later).
    may_change_on_resume: ClassVar[tuple[str, ...]] = ("min_size", "max_size")

    def __post_init__(self):
        if self.name != "fcos_resnet18_fpn":
            raise ConfigError(f"unknown model.name {self.name!r}: use fcos_resnet18_fpn, or add yours in model.py")
        for key in ("min_size", "max_size"):
            check_positive(f"model.{key}", getattr(self, key))


BLOCKS = (BasicBlock,)


def build_model(cfg) -> nn.Module:
    # From scratch, no download. zero_init_residual: each residual block starts as the
    # identity, so the features keep their scale through the network's depth at init.
    features = BackboneWithFPN(
        resnet18(weights=None, zero_init_residual=True),
        return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},
        in_channels_list=[128, 256, 512],
        out_channels=128,
        extra_blocks=LastLevelP6P7(128, 128),
    )
    return FCOS(
        features,
        num_classes=cfg.data.num_classes,
        min_size=cfg.model.min_size,
        max_size=cfg.model.max_size,
        # The images are in [0, 1]; the detector normalises them itself.
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.25, 0.25, 0.25],
    )


def training_step(model: nn.Module, batch, cfg):
    images, targets = batch
    # torchvision's detectors return their losses in train mode: here FCOS's focal
    # classification loss, its box regression (GIoU) loss and its centre-ness loss.
    return model(images, targets)


def build_metrics(cfg) -> dict:
    # COCO mAP is not a sum over images: every rank keeps its images' predictions and
    # targets, rank 0 computes mAP once over the whole validation set.
    return {"coco": Gathered(compute=coco_map)}


def validation_step(model: nn.Module, batch, metrics: dict, cfg) -> None:
    images, targets = batch
    predictions = model(images)  # eval mode: boxes, labels and scores per image
    metrics["coco"].update(predictions, targets)


def predict_step(model: nn.Module, batch) -> list[dict]:
    images, paths = batch
    # Boxes as x1, y1, x2, y2 in the image's own pixels, best score first.
    return [
        {
            "input": path,
            "boxes": [[round(v, 2) for v in box] for box in prediction["boxes"].tolist()],
            "labels": prediction["labels"].tolist(),
            "scores": [round(score, 6) for score in prediction["scores"].tolist()],
        }
        for path, prediction in zip(paths, model(images), strict=True)
    ]


def coco_map(predictions: list[dict], targets: list[dict]) -> dict:
    """val_map: COCO's mean average precision over IoU 0.50:0.95; val_map50: at IoU 0.50.
    pycocotools computes both from every image's predictions and targets, in one pass."""
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        raise UsageError("COCO mAP needs pycocotools: pip install pycocotools (or pip install -e .)") from None
    images, annotations, detections = [], [], []
    for image_id, (prediction, target) in enumerate(zip(predictions, targets, strict=True), start=1):
        images.append({"id": image_id})
        for box, label in zip(target["boxes"].tolist(), target["labels"].tolist(), strict=True):
            x, y, w, h = coco_box(box)
            annotations.append(
                {"id": len(annotations) + 1, "image_id": image_id, "category_id": label, "bbox": [x, y, w, h]}
                | {"area": w * h, "iscrowd": 0}
            )
        for box, label, score in zip(*(prediction[k].tolist() for k in ("boxes", "labels", "scores")), strict=True):
            detections.append({"image_id": image_id, "category_id": label, "bbox": coco_box(box), "score": score})
    if not detections or not annotations:
        return {"map": 0.0, "map50": 0.0}
    labels = sorted({a["category_id"] for a in annotations} | {d["category_id"] for d in detections})
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and table
        truth = COCO()
        truth.dataset = {"images": images, "annotations": annotations, "categories": [{"id": i} for i in labels]}
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(detections), iouType="bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return {"map": float(evaluation.stats[0]), "map50": float(evaluation.stats[1])}


def coco_box(box: list[float]) -> list[float]:
    """x1, y1, x2, y2 (torchvision) as x, y, width, height (COCO)."""
    x1, y1, x2, y2 = box
    return [x1, y1, x2 - x1, y2 - y1]
