# .cu -> .cc for the emulator: kernel launches, __shared__ declarations, the arg-check header.
import re, sys
src, dst = sys.argv[1], sys.argv[2]
s = open(src).read()

def launches(s):
    out, i = [], 0
    pat = re.compile(r'([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<')
    while True:
        m = pat.search(s, i)
        if not m:
            out.append(s[i:]); break
        name = m.group(1)
        j = s.index('>>>', m.end())
        cfg = s[m.end():j]
        k = s.index('(', j)
        depth, p = 0, k
        while True:
            c = s[p]
            if c == '(': depth += 1
            elif c == ')':
                depth -= 1
                if depth == 0: break
            p += 1
        args = s[k+1:p].strip()
        out.append(s[i:m.start()])
        out.append('::emu::Launch("%s", ::emu::Cfg(%s), %s%s)' % (name, cfg.strip(), name, (', ' + args) if args else ''))
        i = p + 1
    return ''.join(out)

s = launches(s)
# extern __shared__ T name[];
s = re.sub(r'extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:\s\*]+?)\s+(\w+)\s*\[\s*\]\s*;',
           r'\1* \2 = static_cast<\1*>(::emu::DynShared());', s)
# __shared__ T name[N]...; -> static + poison
s = re.sub(r'__shared__\s+([^;]*?)\s+(\w+)((?:\s*\[[^\]]+\])+)\s*;',
           r'static \1 \2\3; ::emu::PoisonShared((void*)&\2, sizeof(\2));', s)
# the check header after the last #include
incs = list(re.finditer(r'^#include .*$', s, re.M))
pos = incs[-1].end()
s = s[:pos] + '\n#include "emu_checks.h"' + s[pos:]
open(dst, 'w').write('#line 1 "%s"\n' % src + s if False else s)
