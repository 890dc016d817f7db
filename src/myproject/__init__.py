"""This project's own code: its models, its datamodules and its task. The examples here (an MLP
and ResNet-50, MNIST, CIFAR-10 and ImageFolder, image classification) are yours to replace; the
machinery that runs them is the ``trainkit`` library (docs/fork.md)."""
