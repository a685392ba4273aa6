#!/usr/bin/env bash
# Fetches the Vulkan plugin's build toolkit into one folder, without installing anything
# system-wide: `fetch-toolkit.sh DEST` (`cargo xtask plugins --backend vulkan --fetch-toolkit`
# runs it into target/toolkits/vulkan). DEST gets the layout of a Vulkan SDK (include/, lib/,
# bin/glslc, share/cmake/SPIRV-Headers), so CMake's FindVulkan and ggml's
# find_package(SPIRV-Headers) take it from VULKAN_SDK=DEST.
#
# The packages come from Debian with a private apt state under DEST/.apt (the system's apt
# configuration and lists are not touched): ggml 0.26 needs Vulkan headers >= 1.3.275, so the
# headers (libvulkan-dev, spirv-headers) are trixie's, which are plain files; glslc and the
# loader to link against must run here, so they are the host suite's. The versions are pinned
# below; DEST/VERSIONS lists them (xtask keys its plugin cache with that file).
set -euo pipefail

dest=${1:?usage: fetch-toolkit.sh DEST}
headers_suite=trixie
headers_pkgs=(libvulkan-dev=1.4.309.0-1 spirv-headers=1.6.1+1.4.309.0-1)
# per host suite: glslc, its library, and the loader (linked at build time, the host's at run time)
case "$(. /etc/os-release 2>/dev/null; echo "${ID:-}-${VERSION_CODENAME:-}")" in
    debian-bookworm) host_suite=bookworm; host_pkgs=(glslc=2023.2-1 libshaderc1=2023.2-1 libvulkan1=1.3.239.0-1) ;;
    debian-trixie) host_suite=trixie; host_pkgs=(glslc=2025.2-1 libshaderc1=2025.2-1 libvulkan1=1.4.309.0-1) ;;
    *)
        echo "fetch-toolkit.sh: fetches Debian 12 (bookworm) or 13 (trixie) packages; this host is" \
            "$(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}"). Install the Vulkan SDK" \
            "(glslc, Vulkan headers >= 1.3.275, SPIRV-Headers) and set VULKAN_SDK, or put glslc on PATH" >&2
        exit 2
        ;;
esac
for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "fetch-toolkit.sh: needs $tool (Debian's apt)" >&2; exit 2; }
done
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$keyring" ] || { echo "fetch-toolkit.sh: needs $keyring (apt-get install debian-archive-keyring)" >&2; exit 2; }
arch=$(dpkg --print-architecture)
# The Debian mirror this machine's apt already uses (its first main archive), so no host is
# named here.
mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)[[:space:]]*$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 ~ /\/debian$/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null)
[ -n "$mirror" ] || { echo "fetch-toolkit.sh: no Debian archive found in apt's sources" >&2; exit 2; }
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu")

# Built in a sibling folder and renamed into place: an interrupted fetch leaves no DEST that
# looks complete.
mkdir -p "$(dirname "$dest")"
dest=$(cd "$(dirname "$dest")" && pwd)/$(basename "$dest")
work="$dest.partial"
rm -rf "$work"
mkdir -p "$work/.apt/lists/partial" "$work/.apt/cache/archives/partial" "$work/.apt/debs" "$work/root"
: > "$work/.apt/status"
{
    echo "deb [arch=$arch signed-by=$keyring] $mirror $host_suite main"
    [ "$headers_suite" = "$host_suite" ] || echo "deb [arch=$arch signed-by=$keyring] $mirror $headers_suite main"
} > "$work/.apt/sources.list"
apt_opts=(
    -o "Dir::Etc::SourceList=$work/.apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State=$work/.apt" -o "Dir::State::Lists=$work/.apt/lists" -o "Dir::State::status=$work/.apt/status"
    -o "Dir::Cache=$work/.apt/cache" -o Debug::NoLocking=1 -o "APT::Sandbox::User=$(id -un)"
    # package lists only (no AppStream metadata, command-not-found indexes)
    -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11-icons-hidpi::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::CNF::DefaultEnabled=false
)
echo "fetch-toolkit.sh: reading the package lists of $host_suite${headers_suite:+ and $headers_suite}"
apt-get "${apt_opts[@]}" -qq update
(cd "$work/.apt/debs" && apt-get "${apt_opts[@]}" -qq download "${headers_pkgs[@]}" "${host_pkgs[@]}") || {
    echo "fetch-toolkit.sh: could not download ${headers_pkgs[*]} ${host_pkgs[*]} (a pinned version may have" \
        "left the archive: update the pins in $0)" >&2
    exit 1
}
for deb in "$work/.apt/debs"/*.deb; do
    dpkg-deb -x "$deb" "$work/root"
done

# The SDK layout.
usr="$work/root/usr"
ln -s root/usr/include "$work/include"
mkdir -p "$work/lib" "$work/bin" "$work/share/cmake"
ln -s ../root/usr/lib/"$multiarch"/libvulkan.so.1 "$work/lib/libvulkan.so"
ln -s ../../root/usr/share/cmake/SPIRV-Headers "$work/share/cmake/SPIRV-Headers"
# glslc with its library beside it (the unpacked libshaderc is not on the loader's path)
cat > "$work/bin/glslc" <<'EOF'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/root/usr/lib/MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/root/usr/bin/glslc" "$@"
EOF
sed -i "s|MULTIARCH|$multiarch|" "$work/bin/glslc"
chmod +x "$work/bin/glslc"
"$work/bin/glslc" --version >/dev/null || { echo "fetch-toolkit.sh: the fetched glslc does not run here" >&2; exit 1; }
[ -f "$usr/include/vulkan/vulkan_core.h" ] || { echo "fetch-toolkit.sh: no vulkan_core.h in the packages" >&2; exit 1; }
printf '%s\n' "$headers_suite: ${headers_pkgs[*]}" "$host_suite: ${host_pkgs[*]}" > "$work/VERSIONS"
rm -rf "$work/.apt"

rm -rf "$dest"
mv "$work" "$dest"
echo "fetch-toolkit.sh: the Vulkan toolkit is in $dest:"
sed 's/^/  /' "$dest/VERSIONS"
