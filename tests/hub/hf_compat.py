"""The official `huggingface_hub` against kimi-infer's side of the hub cache.

Run by crates/kimi-cli/tests/hub.rs with HF_ENDPOINT pointing at a local server that speaks
the hub's API (kimi_hub::testing::LocalHub). Each subcommand prints one JSON object.

  fetch CACHE REPO          huggingface_hub downloads REPO into CACHE (for kimi-infer to load)
  find CACHE REPO           huggingface_hub finds what `kimi-infer download` put in CACHE,
                            offline, checks every file against the hub's checksums, and
                            scans the cache as `hf cache scan` does
  refresh CACHE REPO        online snapshot_download over kimi-infer's cache (must fetch nothing)
  local-dir DIR REPO        online snapshot_download(local_dir=DIR) over kimi-infer's
                            --local-dir download (must fetch nothing)
"""

import json
import os
import sys

import huggingface_hub
from huggingface_hub import HfApi, hf_hub_download, scan_cache_dir, snapshot_download, try_to_load_from_cache


def main() -> None:
    command, target, repo = sys.argv[1:4]
    out = {"version": huggingface_hub.__version__}
    if command == "fetch":
        out["path"] = snapshot_download(repo, cache_dir=target)
    elif command == "find":
        out["snapshot"] = snapshot_download(repo, cache_dir=target, local_files_only=True)
        out["config"] = hf_hub_download(repo, "config.json", cache_dir=target, local_files_only=True)
        out["weights"] = try_to_load_from_cache(repo, "model.safetensors", cache_dir=target)
        with open(out["config"], encoding="utf-8") as f:
            out["config_text"] = f.read()
        check = HfApi(endpoint=os.environ["HF_ENDPOINT"]).verify_repo_checksums(repo, cache_dir=target)
        out["checked"] = check.checked_count
        out["mismatches"] = check.mismatches
        out["missing"] = check.missing_paths
        scan = scan_cache_dir(target)
        out["scan_repos"] = [(r.repo_id, r.nb_files, r.size_on_disk) for r in scan.repos]
        out["scan_warnings"] = [str(w) for w in scan.warnings]
    elif command == "refresh":
        out["path"] = snapshot_download(repo, cache_dir=target)
    elif command == "local-dir":
        out["path"] = snapshot_download(repo, local_dir=target)
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
