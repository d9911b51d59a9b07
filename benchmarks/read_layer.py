"""Peak memory and time of reading one decoder layer of a checkpoint.

    python benchmarks/read_layer.py CKPT --layer 1 [--dequantize-one]

Reads every tensor of the layer through the lazy reader, copying each into memory and
checksumming it, then reports the layer's bytes, the seconds taken and the process's peak
resident memory (which counts the touched pages of the memory-mapped shards as well).
"""

import argparse
import json
import resource
import time
import zlib

import numpy as np

from k2deploy.core.checkpoint.reader import Checkpoint


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--layer", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    with Checkpoint.open(args.checkpoint) as checkpoint:
        after_open = peak_rss_bytes()
        checksum = 0
        largest = 0
        for name in checkpoint.layer_names(args.layer):
            array = np.array(checkpoint.raw(name))  # a private copy, as a consumer holding it would have
            largest = max(largest, array.nbytes)
            checksum = zlib.crc32(array.view(np.uint8).reshape(-1)[:: 4096].tobytes(), checksum)
            del array
        result = {
            "layer": args.layer,
            "layer_bytes": checkpoint.layer_bytes(args.layer),
            "bytes_read": checkpoint.bytes_read,
            "largest_tensor_bytes": largest,
            "seconds": round(time.perf_counter() - started, 2),
            "peak_rss_after_open": after_open,
            "peak_rss": peak_rss_bytes(),
            "checksum": checksum,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
