# back to back: the main install with the old base dependencies (commit 18bb567: the split script, the old pyproject)
# and with the new (HEAD), each from a fresh clone with pip's cache off
for rev in 18bb567 HEAD; do
  d=/tmp/cmp61-$rev; rm -rf $d; git clone -q /work/wt61 $d; git -C $d checkout -q $rev
  cd $d
  { echo "== $rev $(git log --oneline -1 | cut -c1-60)"; echo "load before $(cut -d' ' -f1-3 /proc/loadavg)"; } >> /tmp/install_cmp.txt
  PIP_NO_CACHE_DIR=1 /usr/bin/time -f "wall %e s, user %U s, sys %S s, %P CPU" bash .ci/install.sh > $d.log 2>&1
  tail -1 $d.log >> /tmp/install_cmp.txt
  echo "load after $(cut -d' ' -f1-3 /proc/loadavg); packages $(.venv/bin/pip list 2>/dev/null | tail -n +3 | wc -l); venv $(du -sh .venv | cut -f1)" >> /tmp/install_cmp.txt
done
echo done >> /tmp/install_cmp.txt
