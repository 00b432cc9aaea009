"""What ``python -m clsys.pretrain``'s driver does with a config before any worker starts, apart from the config
package below it (which imports no objective, recipe or model):

keys.py   every key with its type, default and meaning, from the config dataclasses: ``--help`` and the
          configuration reference the docs generate
paths.py  every local path in a config (model, tokenizer, STS sets, Tatoeba pairs, an objective's own files)
          resolved on the driver, so that workers and ``<run>/config.yaml`` see absolute ones
"""
