"""Page dump for scripts/traffic_page_dump/run.py (on PYTHONPATH of the server it starts; inert
unless TI_DUMP_DIR is set): every `MosaicKVPool._install` also writes, per installed page, its raw
K/V from the hot buffer just before install and the sealed page's read-back (`decompress`), per
layer, with the caller that sealed it, to TI_DUMP_DIR/<pid>_<n>.pt."""
import os

if os.environ.get("TI_DUMP_DIR"):
    import importlib.abc
    import importlib.util
    import inspect
    import itertools
    import sys
    import time

    _count = itertools.count()

    def _patch(module):
        import torch
        original = module.MosaicKVPool._install

        def _install(self, pages, sealed, keep_hot=False):
            raw = []
            for p in pages:
                hot = int(self.hot_page_of[p]) >= 0
                raw.append(tuple(x[0].clone() for x in self._read_pages([p])) if hot else None)
            callers = [f.function for f in inspect.stack()[1:4]]
            out = original(self, pages, sealed, keep_hot)
            records = [{"page": p, "position": self.sealed[p].position, "raw": r,
                        "read_back": [tuple(x.clone() for x in self.decompress(layer, [p]))
                                      for layer in range(self.layer_num)]}
                       for p, r in zip(pages, raw)]
            torch.save({"t": time.time(), "callers": callers, "records": records},
                       os.path.join(os.environ["TI_DUMP_DIR"],
                                    f"{os.getpid()}_{next(_count):06d}.pt"))
            return out

        module.MosaicKVPool._install = _install

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "mosaickv_sglang.serving.pool":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                _patch(module)
            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Hook())
