#!/usr/bin/env bash
# Builds into dist/python/ (ignored by git) everything scripts/gpu-python.sh needs on the GPU
# machine, which has no cargo and no network:
#   ferry_kv-*.whl     the release wheel (abi3: installs on its Python 3.12)
#   ferry              the `ferry` CLI, release, stripped (for the same-run native figure)
#   wheels/            pytest and its dependencies, for a GPU machine without pytest
#   mooncake-*.tar.xz  with --mooncake: what `from mooncake.engine import TransferEngine` needs
#                      from Mooncake's wheel, plus the system libraries engine.so links that
#                      the GPU machine lacks (from NVIDIA's nixl wheel, under plain names)
#   nixl-cu13-*.tar.xz with --nixl: NIXL's own package from nixl-cu13's wheel for Python 3.12,
#                      unpacked (nixl_cu13/, its two .libs folders with the UCX plugin and UCX,
#                      its dist-info; not nixl_ep_cu13, headers or scripts), for the bench's
#                      nixl-own-* rows, which import nixl_cu13._api by that name
# Usage: scripts/python-carry.sh [--mooncake] [--nixl]
# The options are independent. The runner carries at most 64 MiB with the working tree: the
# ferry files (~10 MB), Mooncake's (~19 MB) and NIXL's (~18.5 MB) fit together, and a call
# that needs only one of the two can leave the other out.
# Needs maturin and pip (MATURIN / PIP override them, e.g. a venv's), cargo, strip, xz.
# Downloaded wheels are cached in ${FERRY_CARRY_CACHE:-~/.cache/ferry-carry}.
set -euo pipefail
cd "$(dirname "$0")/.."

mooncake=0
nixl=0
for argument in "$@"; do
  case $argument in
    --mooncake) mooncake=1 ;;
    --nixl) nixl=1 ;;
    *) echo "python-carry.sh: unknown argument $argument (use --mooncake, --nixl)" >&2; exit 2 ;;
  esac
done

MOONCAKE_WHEEL="mooncake-transfer-engine-cuda13==0.3.14"
NIXL_WHEEL="nixl-cu13==1.5.1"
maturin=${MATURIN:-maturin}
pip=${PIP:-pip}
target=${CARGO_TARGET_DIR:-target}
out=dist/python
cache=${FERRY_CARRY_CACHE:-$HOME/.cache/ferry-carry}

rm -rf "$out"
mkdir -p "$out" "$cache"
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

(cd crates/python && "$maturin" build --release --quiet -o "../../$out")
cargo build --release -p ferry-cli --bin ferry
cp "$target/release/ferry" "$out/ferry"
strip "$out/ferry"
# Pure-Python wheels for the GPU machine's Python 3.12.
"$pip" download --quiet --only-binary=:all: --python-version 312 \
  --platform manylinux_2_28_x86_64 -d "$out/wheels" pytest

if [ "$mooncake" = 1 ]; then
  # Wheels for the GPU machine's Python 3.12, whatever Python runs here.
  "$pip" download --quiet --no-deps --only-binary=:all: --python-version 312 \
    --platform manylinux_2_28_x86_64 -d "$cache" "$MOONCAKE_WHEEL" "$NIXL_WHEEL"
  python3 - "$cache" "$staging/mooncake" <<'EOF'
"""Extracts from the cached wheels what Mooncake's engine needs into DEST:
site/  mooncake/{__init__,engine,libasio,libetcd_wrapper} and the wheel's bundled .libs folder
lib/   libibverbs, libmlx5, libnuma, libcurl from nixl's wheel under their hashed names, with
       the bundled libraries they link (libnl-3, libnl-route-3, libzstd), plus links under the
       plain names engine.so asks for."""
import glob, os, re, subprocess, sys, zipfile

cache, dest = sys.argv[1], sys.argv[2]
site, lib = os.path.join(dest, "site"), os.path.join(dest, "lib")

mooncake = zipfile.ZipFile(glob.glob(os.path.join(cache, "mooncake_transfer_engine_cuda13-0.3.14-*.whl"))[0])
wanted = {"mooncake/__init__.py", "mooncake/engine.so", "mooncake/libasio.so", "mooncake/libetcd_wrapper.so"}
for name in mooncake.namelist():
    if name in wanted or name.startswith("mooncake_transfer_engine_cuda13.libs/"):
        mooncake.extract(name, site)
missing = wanted - set(mooncake.namelist())
if missing:
    sys.exit(f"Mooncake's wheel lacks {sorted(missing)}")

nixl = zipfile.ZipFile(glob.glob(os.path.join(cache, "nixl_cu13-1.5.1-cp312-*.whl"))[0])
folder = "nixl_cu13.libs/"
os.makedirs(lib)


def copy(hashed):
    """Copies nixl's bundled library HASHED into lib/, then every bundled library it links."""
    path = os.path.join(lib, hashed)
    if os.path.exists(path):
        return
    with open(path, "wb") as file:
        file.write(nixl.read(folder + hashed))
    os.chmod(path, 0o755)
    dynamic = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True)
    for needed in re.findall(r"\(NEEDED\).*\[(.+)\]", dynamic.stdout):
        if folder + needed in nixl.namelist():
            copy(needed)


# engine.so asks for these plain names; nixl bundles them as <name>-<hash>.so.<version>.
for soname, prefix in {"libibverbs.so.1": "libibverbs-", "libmlx5.so.1": "libmlx5-",
                       "libnuma.so.1": "libnuma-", "libcurl.so.4": "libcurl-"}.items():
    pattern = re.compile(re.escape(folder + prefix) + r"[0-9a-f]{8}\.so")
    names = [name for name in nixl.namelist() if pattern.match(name)]
    if len(names) != 1:
        sys.exit(f"nixl's wheel: expected one {prefix}<hash>.so*, found {names}")
    hashed = names[0][len(folder):]
    copy(hashed)
    os.symlink(hashed, os.path.join(lib, soname))
EOF
  tar -C "$staging" -cJf "$out/mooncake-0.3.14.tar.xz" mooncake
fi

if [ "$nixl" = 1 ]; then
  "$pip" download --quiet --no-deps --only-binary=:all: --python-version 312 \
    --platform manylinux_2_28_x86_64 -d "$cache" "$NIXL_WHEEL"
  python3 - "$cache" "$staging/nixl/site" <<'EOF'
"""Extracts NIXL's own package from the cached cp312 wheel into DEST, laid out as pip installs
it: nixl_cu13/, .nixl_cu13.mesonpy.libs/ (libnixl, and the backend plugins it looks for next to
itself), nixl_cu13.libs/ (UCX and the bundled system libraries, found through $ORIGIN run
paths) and the dist-info. The rest of the wheel (nixl_ep_cu13, asio headers, scripts) is not
needed."""
import glob, os, sys, zipfile

cache, dest = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(cache, "nixl_cu13-1.5.1-cp312-*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one nixl_cu13-1.5.1-cp312 wheel in {cache}, found {wheels}")
wheel = zipfile.ZipFile(wheels[0])
kept = ("nixl_cu13/", ".nixl_cu13.mesonpy.libs/", "nixl_cu13.libs/", "nixl_cu13-1.5.1.dist-info/")
names = [name for name in wheel.namelist() if name.startswith(kept)]
if ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so" not in names:
    sys.exit(f"{wheels[0]} has no UCX plugin where libnixl looks for it")
for name in names:
    wheel.extract(name, dest)
EOF
  tar -C "$staging" -cJf "$out/nixl-cu13-1.5.1.tar.xz" nixl
fi

du -sh "$out"
ls -l "$out"
