# model.py

import os
import torch
from nnscaler.cli.trainer import Trainer
from nnscaler.cli.trainer_args import *
from nnscaler.utils import set_default_logger_level

set_default_logger_level('INFO')

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(100, 10)

    def forward(self, data):
        x = self.linear(data['x'])
        return torch.nn.functional.cross_entropy(x, data['y'])

class RandomDataset:
    def __init__(self, split):
        pass

    def __getitem__(self, i):
        return {
            'x': torch.rand(100),
            'y': torch.randint(10, tuple()),
        }

    def __len__(self):
        return 100

if __name__ == '__main__':
    world_size = int(os.getenv('WORLD_SIZE', 1))
    trainer_args = TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=world_size, use_end2end=True),
        model=ModelConfig(type=Model),
        optimizer=OptimizerConfig(type=torch.optim.AdamW),
        dataset=DatasetConfig(type=RandomDataset, train_args={'split': 'train'}),
        max_train_steps=10,
        enable_progress_bar=False,
    )
    trainer = Trainer(train_args=trainer_args)
    trainer.run()
