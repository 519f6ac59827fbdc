#!/bin/sh
# Build step of the twine image: installs the story formats into
# /usr/local/share/twine/storyformats/<folder>/format.js.
#  1. every storyformats/<folder>/format.js of the build context (the user's, see README.md);
#  2. the official Harlowe and SugarCube, as the Twine 2 application ships them, from Twine's
#     repository at a pinned commit, when the build host can reach it and the user has not
#     put the same folder in; an unreachable host is no error: the image then holds fewer
#     formats. What could not be fetched is written to /usr/local/share/twine/fetch-notes.txt
#     as "demesne-note: …" lines (the Containerfile prints them on every build).
# usage: install-storyformats.sh CONTEXT_STORYFORMATS_DIR
set -eu
src=$1
dest=/usr/local/share/twine/storyformats
mkdir -p "$dest"
notes=/usr/local/share/twine/fetch-notes.txt
: > "$notes"
for f in "$src"/*/format.js; do
  [ -f "$f" ] || continue
  d=$(basename "$(dirname "$f")")
  mkdir -p "$dest/$d"
  cp -R "$(dirname "$f")/." "$dest/$d/"
  echo user > "$dest/$d/ORIGIN"
done
fetch() { # folder version url
  [ -e "$dest/$1" ] && return 0
  if curl -fsSL --proto '=https' --connect-timeout 10 --max-time 120 -o /tmp/format.js "$3" 2>/dev/null; then
    # keep it only when it is the story format of that version
    if node -e 'let f; require("vm").runInNewContext(require("fs").readFileSync(process.argv[1], "utf8"),
        { window: { storyFormat: (o) => { f = o; } } }, { timeout: 5000 });
        process.exit(f && f.version === process.argv[2] && typeof f.source === "string" ? 0 : 1)' /tmp/format.js "$2"; then
      mkdir -p "$dest/$1"
      mv /tmp/format.js "$dest/$1/format.js"
      echo official > "$dest/$1/ORIGIN"
    else
      echo "demesne-note: official $1: the downloaded file is not that story format; left out" >> "$notes"
    fi
  else
    echo "demesne-note: official $1: not fetched (the build host could not reach it)" >> "$notes"
  fi
  rm -f /tmp/format.js
}
if [ "${TWINE_FETCH_OFFICIAL:-1}" = 1 ]; then
  fetch "harlowe-$HARLOWE_VERSION" "$HARLOWE_VERSION" \
    "$TWINE_FORMATS_URL/$HARLOWE_COMMIT/public/story-formats/harlowe-$HARLOWE_VERSION/format.js"
  fetch "sugarcube-$SUGARCUBE_VERSION" "$SUGARCUBE_VERSION" \
    "$TWINE_FORMATS_URL/$SUGARCUBE_COMMIT/public/story-formats/sugarcube-$SUGARCUBE_VERSION/format.js"
fi
