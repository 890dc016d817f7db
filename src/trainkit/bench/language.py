"""The memory benchmark's language model: ``lightning.pytorch.demos.Transformer`` (an
``nn.Transformer`` between an embedding and an output layer), widened, in a LightningModule written
as Lightning's transformer example writes it (its own steps, plain ``self.log``), with Adam; and
its data, token blocks of a text in WikiText2's file format (``data.synthetic.write_wikitext``).
A module of the kind users bring, not the template's: what ``strategy=fsdp`` shards by its
default policy (each transformer layer a unit, the root the rest). ``PipelinedLanguageModel``:
the same kind of model as docs/add_a_task.md changes it for the pipeline, its layers in one
``nn.Sequential``, whose logits over a large vocabulary are the largest tensor of a step."""

import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer, WikiText2
from torch import nn
from torch.utils.data import DataLoader, Subset

from trainkit.strategies.pipeline_task import PipelineTask


class LanguageModel(L.LightningModule):
    def __init__(
        self, vocab_size: int, ninp: int, nhead: int, nhid: int, nlayers: int, lr: float = 1e-4
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(vocab_size, ninp, nhead, nhid, nlayers, dropout=0.0)

    def loss(self, batch):
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class PipelinedLanguageModel(PipelineTask):
    """docs/add_a_task.md's transformer under the pipeline: an embedding, causal encoder layers
    and the output layer as the blocks of ``net``; plain SGD."""

    def __init__(
        self, vocab_size: int, ninp: int, nhead: int, nlayers: int, lr: float = 0.1
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            Embedding(vocab_size, ninp),
            *(
                CausalLayer(ninp, nhead, ninp, dropout=0.0, batch_first=True)
                for _ in range(nlayers)
            ),
            nn.Linear(ninp, vocab_size),
        )

    def loss_fn(self, output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = self.loss_fn(self(inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        self.log("val_loss", self.loss_fn(self(inputs), target), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Embedding(nn.Module):
    """Token embeddings scaled by the width's root, plus sinusoidal positions."""

    def __init__(self, vocab_size: int, ninp: int):
        super().__init__()
        self.embedding, self.ninp = nn.Embedding(vocab_size, ninp), ninp

    def forward(self, inputs):
        position = torch.arange(inputs.size(1), device=inputs.device)[:, None]
        frequency = 10000 ** (-torch.arange(self.ninp, device=inputs.device) / self.ninp)
        return self.embedding(inputs) * math.sqrt(self.ninp) + torch.sin(position * frequency)


class CausalLayer(nn.TransformerEncoderLayer):
    """An encoder layer that masks each position's future itself (a block takes one input)."""

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return super().forward(x, src_mask=mask, is_causal=True)


class TokenBlocks(L.LightningDataModule):
    """``root/wikitext-2.txt`` in WikiText2's blocks of ``block_size`` tokens: the last
    ``held_out`` blocks for validation and test, the rest to train on (shuffled)."""

    def __init__(
        self, root: str, batch_size: int = 8, block_size: int = 35, held_out: int = 16
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        blocks = WikiText2(Path(self.hparams.root), self.hparams.block_size, download=False)
        n = len(blocks) - self.hparams.held_out
        self.train, self.held = Subset(blocks, range(n)), Subset(blocks, range(n, len(blocks)))

    def train_dataloader(self):
        # whole batches only, as the pipeline needs (its shapes are fixed at the first step)
        return DataLoader(self.train, self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.held, self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.held, self.hparams.batch_size)
