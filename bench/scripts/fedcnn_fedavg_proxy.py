"""FedAvg proxy used to choose the network and learning rate (issue 12): 10 devices, Dirichlet(0.3) on
N CIFAR-10 training images (load_dataset's seeded subsample; the sim's partition, seed 0), in process, no broker; test accuracy per round on
2,000 test images. Run from the repo root:
  .venv/bin/python bench/scripts/fedcnn_fedavg_proxy.py "model=fedcnn;model=fedcnn|lr=0.01" 10000 3
Each variant is model=NAME[|lr=..][|mom=..][|norm=gn][|kw={...}] (norm=gn swaps BatchNorm2d for GroupNorm)."""
import numpy as np, torch, sys, copy, time
from torch import nn
from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.data.preprocess import to_input
from splitedge.methods.data.partition import dirichlet
from splitedge.models import create_split
torch.set_num_threads(1)
N=int(sys.argv[2]); R=int(sys.argv[3])
train,test,info=load_dataset("cifar10","../shared/data/cifar10-jpeg.tar.gz",max_train=N,max_test=2000,seed=0)
shards=dirichlet(train[1],10,0.3,np.random.default_rng(0))
X=torch.from_numpy(to_input(train[0],info.mean,info.std)); Y=torch.from_numpy(train[1].astype(np.int64))
tx=torch.from_numpy(to_input(test[0],info.mean,info.std))
def gn(model):
    for parent in list(model.modules()):
        for name,ch in list(parent.named_children()):
            if isinstance(ch,nn.BatchNorm2d): setattr(parent,name,nn.GroupNorm(min(8,ch.num_features//4) if ch.num_features>=8 else 1, ch.num_features))
    return model
def build(v):
    torch.manual_seed(0)
    kw=eval(v.get("kw","{}"))
    m=create_split(v["model"],num_classes=10,in_channels=3,image_size=32,**kw)
    return gn(m) if v.get("norm")=="gn" else m
for spec in sys.argv[1].split(";"):
    v=dict(kv.split("=",1) for kv in spec.split("|")); lr=float(v.get("lr",0.05)); mom=float(v.get("mom",0.9))
    g=build(v); t=time.time(); accs=[]
    for r in range(R):
        states=[];ns=[]
        for i,idx in enumerate(shards):
            m=copy.deepcopy(g).train(); opt=torch.optim.SGD(m.parameters(),lr=lr,momentum=mom,weight_decay=5e-4)
            gen=torch.Generator().manual_seed(r*100+i); order=torch.from_numpy(idx)[torch.randperm(len(idx),generator=gen)]
            for s in range(0,len(order),32):
                b=order[s:s+32]
                if len(b)<2: continue
                loss=nn.functional.cross_entropy(m(X[b]),Y[b]); opt.zero_grad(); loss.backward(); opt.step()
            states.append(m.state_dict()); ns.append(len(idx))
        w=np.array(ns)/sum(ns); new={}
        for k in states[0]:
            if states[0][k].dtype.is_floating_point: new[k]=sum(float(wi)*s[k] for wi,s in zip(w,states))
            else: new[k]=max(s[k] for s in states)
        g.load_state_dict(new); g.eval()
        with torch.no_grad(): accs.append(round(float((g(tx).argmax(1).numpy()==test[1]).mean()),4))
    print(spec, accs, round(time.time()-t), flush=True)
