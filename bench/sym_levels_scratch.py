import torch
torch.manual_seed(0)
G=32
def q_midtread(x,b):
    n=2**(b-1)-1
    if n==0: return None
    a=x.abs().amax(-1,keepdim=True); s=a/n; s[s==0]=1
    return (x/s).round().clamp(-n,n)*s
def q_midrise(x,b):
    n=(2**b-1)/2
    a=x.abs().amax(-1,keepdim=True); s=a/n; s[s==0]=1
    return ((x/s+n).round().clamp(0,2**b-1)-n)*s
def q_twos(x,b):
    n=2**(b-1)
    a=x.abs().amax(-1,keepdim=True); s=a/n; s[s==0]=1
    # levels -n..n-1 ; max|x| positive side clipped at (n-1)s
    return (x/s).round().clamp(-n,n-1)*s
def q_twos_signed(x,b):
    # choose sign so that the extreme value lands on -n (uses full range)
    n=2**(b-1)
    idx=x.abs().argmax(-1,keepdim=True); m=x.gather(-1,idx)
    s=-m/n; s[s==0]=1
    return (x/s).round().clamp(-n,n-1)*s
data={"gaussian":torch.randn(200000,G),"student_t3":torch.distributions.StudentT(3.).sample((200000,G)),"laplace":torch.distributions.Laplace(0.,1.).sample((200000,G))}
for name,x in data.items():
    for b in (1,2,3,4):
        row=[]
        for f in (q_midtread,q_midrise,q_twos):
            y=f(x,b)
            row.append(float('nan') if y is None else ((y-x)**2).mean().item()/ (x**2).mean().item())
        print(name,b," ".join(f"{v:.4f}" for v in row))
