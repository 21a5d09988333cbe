cd /tmp/cloneB
export PIP_NO_CACHE_DIR=1
{ echo "start $(date)"; uptime; } > /tmp/installB.txt
/usr/bin/time -f "wall %e s, user %U s, sys %S s, %P CPU" bash .ci/install.sh >> /tmp/installB.txt 2>&1
{ echo "end $(date)"; uptime; } >> /tmp/installB.txt
. .venv/bin/activate
pip list 2>/dev/null > /tmp/installB_pkgs.txt
du -sh .venv >> /tmp/installB.txt
{ echo "smoke start $(date)"; uptime; } > /tmp/smokeB.txt
/usr/bin/time -f "wall %e s" python train.py pipeline --preset smoke >> /tmp/smokeB.txt 2>&1
echo "rc $?" >> /tmp/smokeB.txt
{ echo "smoke end $(date)"; uptime; } >> /tmp/smokeB.txt
