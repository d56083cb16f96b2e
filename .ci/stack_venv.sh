# Sourced by .ci/vllm_venv.sh and .ci/sglang_venv.sh: the steps both take to make a venv in
# which a serving stack's Python sources import on CPU.
#
# make_stack_venv STACK VERSION VENV CACHE
#   downloads STACK==VERSION's wheel into CACHE once (reused afterwards), makes VENV with
#   torch (CPU), triton, .ci/STACK-cpu-requirements.txt and this project (editable, pinned as
#   in the main venv), then unpacks the wheel WITHOUT its compiled extensions (*.so) and puts
#   it on sys.path with STACK_cpu_sources.pth. The stack never becomes a dependency of the
#   product. Runs `stack_venv_after_install` (if the caller defines it) right after the
#   packages are installed.
make_stack_venv() {
    local stack=$1 version=$2 venv=$3 cache=$4 wheel src site
    mkdir -p "$cache"
    wheel=$(ls "$cache"/"$stack"-"$version"-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
        python3 -m pip download --quiet --no-deps "$stack==$version" -d "$cache"
        wheel=$(ls "$cache"/"$stack"-"$version"-*.whl | head -n 1)
    fi
    echo "$stack venv: wheel $wheel ($((SECONDS - start)) s)"

    rm -rf "$venv"
    python3 -m venv "$venv"
    # Keep the whole folder out of git without touching the repository's .gitignore.
    echo '*' > "$venv/.gitignore"
    "$venv/bin/pip" install --quiet torch==2.13.0 triton==3.7.1 -r ".ci/$stack-cpu-requirements.txt"
    bash .ci/install_package.sh "$venv"
    if declare -F stack_venv_after_install > /dev/null; then stack_venv_after_install "$venv"; fi
    echo "$stack venv: packages installed ($((SECONDS - start)) s)"

    src="$venv/$stack-$version"
    unzip -q -o "$wheel" -x '*.so' -d "$src"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    realpath "$src" > "$site/${stack}_cpu_sources.pth"
}
