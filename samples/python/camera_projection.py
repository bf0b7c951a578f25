"""Learning a camera's pose from keypoints with fp16 autocast on the CPU. The projection
matrix intrinsic @ extrinsic has entries in the millions (focal lengths ~5000 px times
translations ~2000 mm), beyond fp16's 65504: the forward matmul gives Inf and the loss is
NaN. `--pin-fp32 projection` fixes it.

    python samples/python/camera_projection.py --db cam.db && ampdiag report cam.db
"""
import torch
from torch import nn

import ampdiag
from _sample import Summary, parse_args, run

POINTS, BATCH = 256, 8


class Projection(nn.Module):
    def forward(self, intrinsic, extrinsic, points):
        camera = intrinsic @ extrinsic                          # [b, 3, 4], entries ~1e6-1e7
        projected = camera @ points.transpose(1, 2)             # [b, 3, n]
        return projected[:, :2] / projected[:, 2:3]             # pixels


class PoseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.translation = nn.Parameter(torch.tensor([[100.0], [-50.0], [1800.0]]))
        self.projection, self.encoder, self.refine = Projection(), nn.Linear(2, 16), nn.Linear(16, 2)

    def forward(self, intrinsic, rotation, points):
        extrinsic = torch.cat([rotation, self.translation.expand(rotation.shape[0], 3, 1)], dim=2)
        pixels = self.projection(intrinsic, extrinsic, points)
        normalised = (pixels.transpose(1, 2) - 1000.0) / 1000.0
        return normalised + 0.01 * self.refine(torch.relu(self.encoder(normalised)))


def main():
    args = parse_args(__doc__.splitlines()[0], "camera_projection.db", 20, ["projection", "encoder", "refine"])
    torch.manual_seed(args.seed)
    model = PoseModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    intrinsic = torch.tensor([[5000.0, 0.0, 960.0], [0.0, 5000.0, 540.0], [0.0, 0.0, 1.0]]).expand(BATCH, 3, 3)
    rotation = torch.eye(3).expand(BATCH, 3, 3)
    points = torch.cat([torch.randn(BATCH, POINTS, 2) * 400.0, torch.randn(BATCH, POINTS, 1) * 100.0 + 3000.0,
                        torch.ones(BATCH, POINTS, 1)], dim=2)
    with torch.no_grad():
        true_extrinsic = torch.cat([rotation, torch.tensor([[0.0], [0.0], [2000.0]]).expand(BATCH, 3, 1)], dim=2)
        target = (Projection()(intrinsic, true_extrinsic, points).transpose(1, 2) - 1000.0) / 1000.0
    summary = Summary()
    with ampdiag.attach(model, scaler, db=args.db, overwrite=True, pins=args.pin_fp32) as handle:
        for _ in range(args.steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(intrinsic, rotation, points).float(), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scale = scaler.get_scale()  # after update(), as the report shows it
            summary.step(loss.item(), handle.last_step_skipped, scale)
    summary.print("camera_projection", args, handle)


if __name__ == "__main__":
    run(main)
