#!/usr/bin/env bash
# Builds Ladder's built-in default corpus, offline and deterministically, from text that Debian
# packages ship (installed by scripts/install-deps.sh):
#   bible-kjv (+ bible-kjv-text)  King James Bible, one chapter per document       (public domain)
#   fortunes, fortunes-min        fortune cookies, one fortune per document         (BSD / free)
#   jargon-text                   Jargon File 4.4.7, one lexicon entry per document (public domain)
#   wordnet-base                  WordNet 3.0 glosses that carry usage examples,
#                                 40 synsets of one lexicographer file per document  (WordNet licence)
# Output: one JSONL file, {"text": ..., "source": ...} per line (default data/corpus/default.jsonl).
# The file is written to a temporary name and renamed, so if it exists it is complete and this script
# does nothing. Usage: scripts/make-corpus.sh [OUTPUT.jsonl]
set -euo pipefail
OUT="${1:-data/corpus/default.jsonl}"
if [ -s "$OUT" ]; then
  echo "make-corpus: $OUT already exists, nothing to do"
  exit 0
fi
for need in /usr/lib/bible.data /usr/share/games/fortunes/fortunes /usr/share/doc/jargon-text/jargon.txt.gz \
            /usr/share/wordnet/data.noun; do
  [ -e "$need" ] || { echo "make-corpus: $need is missing: run scripts/install-deps.sh" >&2; exit 1; }
done
command -v bible >/dev/null || { echo "make-corpus: the 'bible' program (package bible-kjv) is missing: run scripts/install-deps.sh" >&2; exit 1; }

mkdir -p "$(dirname "$OUT")"
TMP="$OUT.tmp.$$"
trap 'rm -f "$TMP"' EXIT
# Fixed locale so nothing (sorting, tool output) depends on the caller's environment.
export LC_ALL=C.UTF-8 PYTHONHASHSEED=0

python3 - "$TMP" <<'PY'
import gzip, json, os, re, subprocess, sys

out_path = sys.argv[1]

# Control characters other than newline; tabs are expanded separately so indentation survives.
CTRL = re.compile(r'[\x00-\x08\x0b-\x1f\x7f]')
# Only real HTML tag names: the sources use <nick>, <Ctrl>, <EOL> ... as content, which must stay.
HTML = re.compile(r'</?(?:a|b|i|u|em|strong|tt|code|pre|p|br|hr|font|span|div|big|small|sup|sub)'
                  r'(?:\s[^<>]*)?/?>', re.I)
ENTITIES = {'&amp;': '&', '&lt;': '<', '&gt;': '>', '&quot;': '"', '&nbsp;': ' ', '&#39;': "'"}


def clean(text):
    # Overstrike ("_\bX" underline, "X\bX" bold) from old nroff output: keep the final character.
    while '\b' in text:
        new = re.sub(r'[^\n\b]\b', '', text)
        if new == text:
            new = text.replace('\b', '')
        text = new
    text = HTML.sub('', text)
    for k, v in ENTITIES.items():
        text = text.replace(k, v)
    text = text.replace('\r\n', '\n').expandtabs(4)
    text = CTRL.sub('', text)
    lines = [l.rstrip() for l in text.split('\n')]
    text = '\n'.join(lines)
    # At most one empty line in a row; no leading/trailing blank lines.
    text = re.sub(r'\n{3,}', '\n\n', text)
    return text.strip('\n')


docs = []  # (source, text) in final order


def add(source, text):
    text = clean(text)
    if len(text.strip()) >= 8:
        docs.append((source, text))


# ---- King James Bible: one chapter per document, in canonical book order.
BOOKS = {
    'Ge': 'Genesis', 'Exo': 'Exodus', 'Lev': 'Leviticus', 'Num': 'Numbers', 'Deu': 'Deuteronomy',
    'Josh': 'Joshua', 'Jdgs': 'Judges', 'Ruth': 'Ruth', '1Sm': '1 Samuel', '2Sm': '2 Samuel',
    '1Ki': '1 Kings', '2Ki': '2 Kings', '1Chr': '1 Chronicles', '2Chr': '2 Chronicles', 'Ezra': 'Ezra',
    'Neh': 'Nehemiah', 'Est': 'Esther', 'Job': 'Job', 'Psa': 'Psalms', 'Prv': 'Proverbs',
    'Eccl': 'Ecclesiastes', 'SSol': 'Song of Solomon', 'Isa': 'Isaiah', 'Jer': 'Jeremiah',
    'Lam': 'Lamentations', 'Eze': 'Ezekiel', 'Dan': 'Daniel', 'Hos': 'Hosea', 'Joel': 'Joel',
    'Amos': 'Amos', 'Obad': 'Obadiah', 'Jonah': 'Jonah', 'Mic': 'Micah', 'Nahum': 'Nahum',
    'Hab': 'Habakkuk', 'Zep': 'Zephaniah', 'Hag': 'Haggai', 'Zec': 'Zechariah', 'Mal': 'Malachi',
    'Mat': 'Matthew', 'Mark': 'Mark', 'Luke': 'Luke', 'John': 'John', 'Acts': 'Acts', 'Rom': 'Romans',
    '1Cor': '1 Corinthians', '2Cor': '2 Corinthians', 'Gal': 'Galatians', 'Eph': 'Ephesians',
    'Phi': 'Philippians', 'Col': 'Colossians', '1Th': '1 Thessalonians', '2Th': '2 Thessalonians',
    '1Tim': '1 Timothy', '2Tim': '2 Timothy', 'Titus': 'Titus', 'Phmn': 'Philemon', 'Heb': 'Hebrews',
    'Jas': 'James', '1Pet': '1 Peter', '2Pet': '2 Peter', '1Jn': '1 John', '2Jn': '2 John',
    '3Jn': '3 John', 'Jude': 'Jude', 'Rev': 'Revelation'}
# -f turns pretty-printing off: one "Ge1:1 text" line per verse, easy to parse exactly.
kjv = subprocess.run(['bible', '-f', 'Gen1:1-Rev22:21'], check=True, capture_output=True,
                     stdin=subprocess.DEVNULL).stdout.decode('utf-8')
VERSE = re.compile(r'^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$')
chapters = []  # [(book, chapter, [verses])]
for line in kjv.splitlines():
    m = VERSE.match(line)
    if not m:
        raise SystemExit(f'make-corpus: unexpected line from bible: {line[:80]!r}')
    book, ch, text = BOOKS[m.group(1)], int(m.group(2)), m.group(4).strip()
    if not chapters or chapters[-1][:2] != (book, ch):
        chapters.append((book, ch, []))
    chapters[-1][2].append(text)
if len(chapters) != 1189:
    raise SystemExit(f'make-corpus: expected 1189 Bible chapters, found {len(chapters)}')
for book, ch, verses in chapters:
    add('kjv', f'{book} {ch}\n\n' + '\n'.join(verses))

# ---- Fortunes: one fortune per document, files in sorted order.
FORTUNE_DIR = '/usr/share/games/fortunes'
# ascii-art is pictures, not text.
SKIP = {'ascii-art'}
for name in sorted(os.listdir(FORTUNE_DIR)):
    path = os.path.join(FORTUNE_DIR, name)
    if '.' in name or name in SKIP or os.path.islink(path) or not os.path.isfile(path):
        continue
    raw = open(path, 'rb').read().decode('utf-8', errors='replace')
    for part in re.split(r'^%\s*$', raw, flags=re.M):
        add('fortunes/' + name, part)

# ---- Jargon File: one lexicon entry per document (entries are already alphabetical).
jargon = gzip.open('/usr/share/doc/jargon-text/jargon.txt.gz', 'rb').read().decode('utf-8')
lines = jargon.split('\n')
ENTRY = re.compile(r'^   :(.+?):(.*)$')
LETTER = re.compile(r'^  \S')  # "  A": start of a letter's headword index (noise), or Part III
entry = None
n_jargon = 0
for line in lines:
    m = ENTRY.match(line)
    if m:
        if entry:
            add('jargon', '\n'.join(entry)); n_jargon += 1
        head, rest = m.group(1), m.group(2).strip()
        entry = [f'{head}: {rest}' if rest and rest != '//' else head, '']
        continue
    if LETTER.match(line) or line.strip().startswith('Part III. Appendices'):
        if entry:
            add('jargon', '\n'.join(entry)); n_jargon += 1
        entry = None
        continue
    if entry is not None:
        entry.append(line[3:] if line.startswith('   ') else line.lstrip())
if entry:
    add('jargon', '\n'.join(entry)); n_jargon += 1
if n_jargon < 2000:
    raise SystemExit(f'make-corpus: expected >2000 Jargon File entries, found {n_jargon}')
# {cross references} become plain words.
docs = [(s, re.sub(r'\{([^{}]*)\}', r'\1', t) if s == 'jargon' else t) for s, t in docs]

# ---- WordNet: synsets whose gloss has a usage example (sentence-like text), grouped by
# lexicographer file, sorted by headword, 40 per document.
LEXNAMES = ['adj.all', 'adj.pert', 'adv.all', 'noun.Tops', 'noun.act', 'noun.animal', 'noun.artifact',
            'noun.attribute', 'noun.body', 'noun.cognition', 'noun.communication', 'noun.event',
            'noun.feeling', 'noun.food', 'noun.group', 'noun.location', 'noun.motive', 'noun.object',
            'noun.person', 'noun.phenomenon', 'noun.plant', 'noun.possession', 'noun.process',
            'noun.quantity', 'noun.relation', 'noun.shape', 'noun.state', 'noun.substance',
            'noun.time', 'verb.body', 'verb.change', 'verb.cognition', 'verb.communication',
            'verb.competition', 'verb.consumption', 'verb.contact', 'verb.creation', 'verb.emotion',
            'verb.motion', 'verb.perception', 'verb.possession', 'verb.social', 'verb.stative',
            'verb.weather', 'adj.ppl']
POS = {'n': 'noun', 'v': 'verb', 'a': 'adjective', 's': 'adjective', 'r': 'adverb'}
groups = {}
for fname in ['data.adj', 'data.adv', 'data.noun', 'data.verb']:
    for line in open('/usr/share/wordnet/' + fname, encoding='utf-8', errors='replace'):
        if line.startswith('  '):  # licence header
            continue
        head, sep, gloss = line.partition(' | ')
        gloss = gloss.strip()
        if not sep or '"' not in gloss:
            continue
        f = head.split()
        lex, pos, n = int(f[1]), f[2], int(f[3], 16)
        words = []
        for i in range(n):
            w = re.sub(r'\([a-z]+\)$', '', f[4 + 2 * i]).replace('_', ' ')
            if w not in words:
                words.append(w)
        groups.setdefault(LEXNAMES[lex], []).append(
            (words[0].lower(), f[0], f'{", ".join(words)} ({POS[pos]}): {gloss}'))
for lexname in sorted(groups):
    items = sorted(groups[lexname])
    for i in range(0, len(items), 40):
        add('wordnet/' + lexname, '\n'.join(t for _, _, t in items[i:i + 40]))

# Exact duplicates (the same fortune in two files) would only over-weight that text.
seen = set()
n_out = 0
sizes = {}
with open(out_path, 'w', encoding='utf-8', newline='\n') as f:
    for source, text in docs:
        if text in seen:
            continue
        seen.add(text)
        f.write(json.dumps({'text': text, 'source': source}, ensure_ascii=False) + '\n')
        n_out += 1
        top = source.split('/')[0]
        c = sizes.setdefault(top, [0, 0])
        c[0] += 1
        c[1] += len(text.encode('utf-8'))
    f.flush()
    os.fsync(f.fileno())
for top, (n, b) in sizes.items():
    print(f'make-corpus: {top:9s} {n:6d} documents {b / 1e6:6.2f} MB')
print(f'make-corpus: total     {n_out:6d} documents {sum(b for _, b in sizes.values()) / 1e6:6.2f} MB')
PY

mv "$TMP" "$OUT"
trap - EXIT
echo "make-corpus: wrote $OUT ($(du -h "$OUT" | cut -f1))"
