"""TorchRec interop: modules, configs, plans and constraints taken as they are."""
