"""Profile embedding_bag_bwd_rows and row-wise Adagrad (H100): old (HEAD) vs new, + sweeps.

    PYTHONPATH=. python prof_bwd.py [--sweep] [--check]
"""
import base64, importlib.util, os, sys, time, zlib
import torch
from benchmarks.kernels import dlrm_rows, make_ids
from dtrec.ops import triton_kernels as K
import dtrec

OLD = (
    "eNrtPWmT28aV3/kreuWqGBhhOIezLocKXStZE6/LlqWV5HW2WAwIEj0kRBCgAXCoyfXb9x19AiBndNhOsutKbKKP192vX7+7"
    "ex48ePC6ypqyEGtZFTKvxXVZiWYlxWaXN9lpk8xzKbZlmctUyM1cpmlWLEVeluvdNhJZU4t5sljvkyoVSZGK610NDcttk22y"
    "P8uqHg4GL/IkK0Qji7qsalEW+e1IFGWzQjgrWUmxLso9VFyLp6+pUSQ2sl5JKKrEtioXsq7Fsip32zrCMQYN9cpqgCKSXVMu"
    "qyQdiqtksVKLEDXNS9ZZKmmKebIrFtCLpogF210lT5uyWqwGlbwGcMVCimA2O4nN52wWPhKzWSPrpj4rt/UZ/oobQlaskDXc"
    "3s5mYlFutkkF84WJbXDBgBBAQp7clrtG1CuoS8X8VsgbWd3qKeIaRoPBCQyxl9ly1dSz2QiwI8V1njTi4vSpmO+uYS4iuN5+"
    "dhmJ+fXF54iR6+3F56FYlTltRJLn4gfYjkWSC9orwLgQr2nXZrMdzA7wZIaYUJO4vL6uJXztpmIkOkUPRQX7Ee/EiUizDRZN"
    "Z7MIoELx6SZ5U1Yj/AlQKwBfN0kFCIUpA656QFko0DhIqCdMaVEWTbbclbs6HBISvL447aL5/LdQPvkBOuJGIBQu/+zSLS92"
    "mxgn3O6DYK+ELGDHYGsCwqxMGth4UcmEkIdlNO4jUePmAA43yS3vmEi4KhzBymczhHMbU4k7iStEDfyAjY4XZV6362Dzsqpu"
    "BNRvgRagyW5TIKkDqQBcghoigI1MCu78xdkcTpsFgDVQXjcwaexZ7zZ0HmEBCnU3Sb6TZugzxkKW1posShwtq3g9EQ/KG4kV"
    "BRzgJX8+oqX27MEV7OIT2M0LWi60h8IAQM1DIjDqxrOY6N2XqsscaaxTSLDUBurK86kYj8U5QMRD7sxkcnpBVbksAh4Fhh2K"
    "58BkyiJBVG1lFdfJZgsUZA6TwGODk/9eEYNiYmoroOJJBLhpkjwG0kJUG/p+xDgSQDFZntdq23iZeqcnkhbmfD1kQncoBUpp"
    "7MEVnnzmeMlisQPWmgA3AfzSJIfi5Q6IohBfvfjB8Ml91qxguNcvv3n9/Pv4m+9fX7188fLq9fgCAT548GAwuK7KjYjj6x3S"
    "dByLbLMtqwaQB8w1QdTUqk1zu8WRVf33yUamr3eAq8FAFTEj1B/E4fyvYZ4Uy12yhFMBXC5XYLGXhsqcezCIY+BIMJmxmAC6"
    "hHjwstx/Dfy5fhDxd5Imm3i3TQEBdGwPlVtGrFsY6RMDAcbzfer176+9C8r1Pj1Y0e0LEPdZLWOYK8qcvmUcadKFVy97YbSK"
    "vX5TQPGzx3+Mn3z3/Ktv46eA54vLLwbq8zv8/HwwGKTyWiBVx3NgAes62CRv8XOEJzoUp1+KBvd/Al+R0P+ajnj0Bw8CBTwS"
    "wFvnIIGA6yjOxfCoIgaZv61D0hcqJcB3W+Q2wM14PJKNdHSGSLEIngDEKUx0kxWBu5RI01oh3zbxttzDmS6v40ucfADz04sA"
    "dnkRhiFBqyTQfqGBGgiLNLvp7RbppvAL6y8imsZvTbk4OxOfXQJ0hUPVOcCTPRJGPXHQKf4qvgc5QliFT0biJ2KYNXIThKK+"
    "LRao9IivX/zwSAA7zkEpArYL8hLVHsWZEbzYJqDnKNBDd3m4CmwxxCmHCnIosmvdGgUqTkKASiKFu2i9jgJqN9vmNmj0KmjC"
    "/FPP+XEhqJHiQSQLV8kNisJiB3oGUGQCXBTgS0DCfpXB8U+UbkWNK/lGLppHpD4qDUmBLlC8ktwF9YukTiRq0N6KWxTCpzKX"
    "G+CbemCWjwI4uhQpcC8J3BDHLz20NIiBZgikKHPA9JfinNcPRXIfg/JZ1sEFYuATcfrx/kF6R20X4P6HIrc3WcNY7rIQxkJA"
    "01aSKd42FR90T+WxxbjV9ssRJ7ZQix1bwnLRadGGimqE/drWe/sxL3dF6g5ZVWXlD2bbJs1iFdeg26s1aAHKn//5+FX84tWP"
    "oFXmQ1DxQGl5u61s1ZPnP3z/9FVfrWJgh6uetqtCw69ggpN51JbFoDKIGg6cjGUwD0HxAMUpznDlk2wKnz/GzUTpLNk0gvbA"
    "PqCLL75BduMgX1dZiioP6UGR0PyF1q3nF4aowIO9Anx/IwKggEisQ9I6XA0CdYg1glEMfDgcApsEimetCv8Nk9B6EqpbJR6d"
    "2SwjhUxB0JoRNJ8CCOF8KzVtCK1wiVXEqOi3ABpPR2+mBB6Rh5pn6mnpAI/QiTJGnKEyhjoWsglUUI2efU5liWYlhIb9qoRz"
    "Cfgn8MCszoH/0lm9QAUQtgSBAjhUetBmAn3ulPU5Pe+heA0cAZcH3YmPaJGHii5w04TJMduQjoLMEDU8bmP2CJfVZLkcih9R"
    "vbIkiRPOSDdEm1EheXIeqbMBmEFNN0nT2piuATAytEGJs6XSCOk0JCsT0Yt2A54lUm1xgZGCzKWo1SILB8hzWBDrnFmRyrdD"
    "TdrqzCFNAPUr4oqzNDhnAZied2ouQktdloNAMwQD4s2eYAauak5Vu5N2A/YA0Ch5maRBiyEBtbAVo3mX01RzMmjDtpRaTu3C"
    "63BB03rYlAG0IiuEu5Kx6fT1e8EyevrIIj3WA49LT69PxFeuxoPCGeUWbDjN7dOalpqW6IPYl9UaTFtN8nlZbiMkEzoFSZXf"
    "KokVDtUiyi3PaI9OgAD28PeCOAlMNeI18iSQm0FLaPAQmycVaOEyOLcsR7cCPaVeQ0vqQMD4pF27XJeK8B9tMTtosSLA3yts"
    "irRJLVmk6kOFPBNl85gRB1oT80owcPqa2zPo9LuGwakndkS+kZ+jUcTrJEREhC7d+bvQrmJb4gLyA7j5LjQNDXawx+8JnqlD"
    "5mGxYIUoAIXWqOnV6zEDAEaMjqfxeQ+1HEE2UzxiUM3jNyIIcNjfAxcE5ZF+fzk2mxKGXle9AQ/xlKZ2ZI20ziLtKH+HDrYR"
    "wMaF1VYUmDMAx/EhYmIyikiNnLI8gEISp1gUidHUBeViTUP2sGVh/cYQqIFkUDk8D9tQ8T9qmR51OChGBcNbPAsQPR+l2xzb"
    "Qnfc1tiwdlQR9PRNMyTrh9xk0HO4SMktf0pG4tU3zy7OL9HVZZQVMQfqXKxG5CnMlBPCCDs+e3ZCn4jnBfqo0t0CrXiSJkGV"
    "VDK/DUWzB625KTcZWBUgJbW+EWnRRYrzCngPcqGhizlAD0jgQBFUJJK3WQ3EjHqzj008TTQCWj+BVQaBT96nHTLUSMsEVjbZ"
    "8TLWUwBUmuEVB9sViq0DqGwDbZBrnwrFAgyD9igiq2NSPezOax3XyCTxb2Nx7s9B/Tix/FfBgWGG56DY0GToI3R1bVeGONq3"
    "GarLFJTejISlfuJp89rhNLQCDZV6KD54A4VkYFgwSw0tUitAOKpsSPx0qIyouLkNFdXrg6fNwI594hkmxr7tGid+lWcMt40U"
    "v0Kjyi9lPttq2TeSVUXI1m6ZHE4ZbqDftesS1PXKYodtIX7kmEDHWuBKCM8jdnwx0vtanqgpdZ0EppljfEMVO2O0c4H/a70x"
    "L5hgOeKChoJ1apNlsOVoAzv/UXriQGyUP+rxciqL5jsKToxATWWWsSnTHah5abmoAXaxHCpXJ60SFFQgn2SXg0rL3mRNMyzK"
    "Hym11rp9gjyplrJulN+evP+gF9+UpK0DtJtsIck5AsaBLMQyu5HFUDzD86yc28Qf9Va2rAEgwRtgdrUzFUABesbnt1SGih1Y"
    "KMtmpdb7hDZYLFZysR5p5yrvOk7XixxELAiQvbIqpCI3YCBkCoRMWddZJuiZ77MVoFyzY3YCRKQG4PrRqqqy+a6RAnUkVB1T"
    "gSEHsiWUiyNBHxVWIIRK1oB8DuXgqY/YRieLU1kTbuThcqpsKc8AIQtEiy70vMB69klN08KBrFmCVtIKiYj30DFMTNwJiIxN"
    "MnZpMRtHzNTOhNDLXXHopd5gpAqXhaqxkG+bKmGPFxExDgeoCdVuXb2l7R6NBkbioKQc93CwPZL39XVEXClyOZH1CEQIO9Is"
    "JvKkWN8/lu2M3dMzRg9CGhGzGeO/Qs9MY8m6JH7PIxnf1Km4GNhFMP9g9djMJXA8K3bIUCvL5ixiCFDbxFQQqdM0NqX0SYBD"
    "689pjXtptHAqJNI5ACnUNGMWiK42Ik0ju3SJ7uk45axyYdy0KJc6nmSYoOuy9lyvxuXqaMcsRLCXcW6q4NDA1wtVQ1hAVyb4"
    "ntNuPWscgQV50Mc3CTR63PWF08CjNgXWJ0FP1JJ+oPcEVAS/KbmB3RagDPktnANwvKE+HMdbMfJaPe8zUzwfXosvWg3stsE2"
    "tRdBFAs7xizV3yUuOz46AeisNxr0n/LWdvguTf2PsjzG/USE5r5VAdw+bCCM7Ur6myqzdaxDOX21T8f6CHVsRDpCY/PLNvAC"
    "Jch/DmDVFSuH1EUbifp/xfEjK47vohE+SZan89tT1HE4BgsStEZLEZTD0TUofqNZZ+tmmN1iFAXUwSjLAA2g0ATnuuLpDqnE"
    "TZVVdlR8gL6hHUku+BYknNNRMOgjktZF5DI7JXIcDxEuBoNhvkvf8nLyuaH7gzi2aqwc4SHFRIO2t1wVO6EGCw7nNrdzs5gL"
    "ffs6LyOxytRwbmaE7UF5E3qsgy3I0+/b5OzPUmGNvBytsinYrMUy8JtpRz5jHQiwDmBGpzS1d91Zx8VwnDWOOnqXnka3n557"
    "W/yqgbrMtAu8RG+Y9q6dh+gRY7cbItWq6mGnoybVv47F38v1EPTWoNuIFEofjexNKNdK28QYR7uCOkDVAf+TXvwxlxyDVO5O"
    "omC1N9Ba70s/3owLJFB+LpqNGSEk38x5D67LnDwrSOyk5AGpfAmk0kV528lyJjRZhW1RjAE7PHQjwQ4PNE5NR4cZwb+1p6Nf"
    "/X03+ab29uNHhXUSJABe5GjW6LyXwObb2IglVJ7W26SCeWGWSIaxbxX09sx5Tghk+wvN0TSrm6xYNCJQFg7sZAgksQPTK1W2"
    "00vcXLQmQWY0nHg4m+2K7KedBFX1Vvk5Y6QxDgaqjL8ZiQhdpUxA+XaR72owztnA223QxoaZuml3yKeGYA2i6U2xIkoqgzoK"
    "8ZP5qtJDuHpHs7OhRTYvCoBJGTMMVKcYrnUGo6mb0C/NFdeYhdUueWi0jQmuhzn/ejrlhLwtKLk2wEY/HPQYUS4+Uflvk2/Z"
    "C2xAtZqAzQ1N1OJglRITUaGx6ZSl/VA5F5LMapOph8mpBIl6uwvrB6EzJ7iROzyi1CDNQsMvFxRlyU3Qsl33YawvzaGWS3I0"
    "Ejw3w4Gn66YLlItFXFeLVgFF5U0RgIvbKQg4CTQGTYGLiVYp5UiZog9JJDhMYzqfAND0xq5h8gb5slk1Ju5O1IqxCju1Egi+"
    "vV/yAIiKRYijsYcLYO4q0rvxJLxxEwEs8nCaw6FwC1QqAGVmEYUTXaCAKlTiEQbZyMOlmEVZpVJhC9UZlbYA4yw6KQtzmXMS"
    "MG8VDM9JBx46+PQqHsDJlTq43s6+VHmZhh/66QeUKGpROwbtx/Ode0YDSCqVm6B9gZysioiwuBRvDFC9mWNyGZyI4OIsBx6G"
    "GVbo5kGvKbml8GipeeqDB8vbw/loMI/2FvhlsmhySmoyuwnITsR19lajdwQSu5HVJiuQmy8Y24UJ6/ixf9jOD4n9+/F451QB"
    "aQDo/qi6fyDdln4sva8dhdN/wTD3P1/IGSjYjSVZBnk05jzoqO4uAM1Q7xvzXOrAlMuxcQPhdBmN81D4d+mMvvwYkV8VWl22"
    "gnwdDZU3ewls2Z1BSzC45GqCZ56cgBYEg9cX9UUlD8TPYocRBwc8Glov+uf3cyinRJ8vov1fJ1oFWiomUhlEjcjcEKBaRfoC"
    "giY6EDq7aiHVypR1ZL0RKkikzVnXr82hHcfTPrkYTcHQ0F+j04upmzpFNlMltzJpYkpfzWVyI61r1jOqFHDtUDAGljKuIj16"
    "pEQBBwrUJFUn1/t+NP1KZ1e5ngw22PkigVU9ddoUTZU18UATm+qCRidgoVVKEA5q/mreTlNmUMGhpLADQeu6Z9pZcROjHB2r"
    "0LrG7E0m98HpReRCHYLZtNkGIBXHF6Fnv/ZZ2eRdJss0NOwh0uNx8B72u14lWwkDhZQnOXhHL4Uel/97cld0QJmgiGhD6YBK"
    "Rda9LlV9S8HXnu/ymf7rcJj3Cptrw9qwnKeuNkV6Zo9pfdgvuh9Ww2ZImqK+QKdUVL0h2gRtq6yc6E4CDUza5Q71QTa9sVzl"
    "iX9aYzCcbgKy1s2rbIXbj11ko4xXPyA9FN+ktdjs6gbUcKO+EOSAorCtGRjXL/R87hgT5CZAkLeOt0Cxa3L1oDHpWMhYB+CU"
    "AYgTAy60gW60tKRhBReBOAow3vYUdFK0iqsC2/uSD84OLAxMABDzrDnNUoCcoTXMQe96KF7RHQpckRIJgZ1NzeJE35VkVnIw"
    "iLzshJDNEdSbrQPJejcOhZTvDCJrJ6GOOguXejiI7Gh1/pWfdlR7OTRWuf4g2Muh0WwOT0g1MvPIUf268GPXRtZqNLjSlm6n"
    "jHtjj5qn+tKP7vFZRsppsb7n/7wTf/78t21Ja1MDmbUalxoBjBgudkXJ55bpKsWerQTsYcwYQO6odXrVUSdn1pa4ZDFoB1Wj"
    "waEAaicJoS8M2ROCpBQ1a4l0WGvkqBx8lmNeMTTdGORjTcDlbPmPX1c7hWnHCRZxFlxt+qk69JrIxa6Bwxp4g/AOxdzLgWlN"
    "xNb+O4MZqqHEwftRhacF8aig/NDxHDseENAKQ993h9Mg5xaiZeI0RZVxOu2l7w/XvtSBBQCuI/bUqmNmfqrX1PWCqbN3oJF7"
    "uNszVAD8CfqFvh/NAODIPJ4t3Rzhmctnx8NErbyRvr3WCSNm5F8iZaTPcznpI8VjKRyGQ1rvVNDKPkAzGulreqwNmbZ3tjIE"
    "GrUDRt0MBY/Nd2u6UuIXyTkwXNvjL448s9LME1NmzuFR3bmdk/B/WIs+pB4XnNqk3vK4X8qARu/MmOOIWDxxE5eNE4NQgeo0"
    "VJeBgQ+gQvjnbBtYLQp3QHEsFa86BKudEKCgIkgNbvoeyQBukL+VEfCvHtT/NQP1TvD4MFz+7xndyTaJCK3rBktHO21Hj93E"
    "jf65EPVC9ZDibXGSpjHqoDaM70bal8Zf2brxwIQLYCbQEcMFqOm0tUvmbvBvesgFiHwaOf93r8CdGzIG6gyWSEFNiMQmkX4r"
    "sAYCPEQ090iP7hJ1lr4FMNBrWJQFnqIAXScJRiOc9ZNkS7ZbWaSBSS14a+uV2ataKJG+y/M4z9YygKYwduhf1NGNPTg4sq5Y"
    "AobeTu1kQkffxRmgu5fcM5PzaVdDYx0mUfk3dXhQLbPakXY/HdCkWrKo5fnDoRBLjvS1AqqnLYmlToWnc/nKVh8QxE2o1faP"
    "nY9gX2DqjeC2Xpj48GvqBl1+UZYej9b2h3Xz+wZs7QXn0zH0oqO7pm86VErOkEMDXZpwyqpQJcCYGLdRQOB3+A7h2g++YI0+"
    "Hz3dsTgeezaJC4+EGxZFXjEvm9WQsj44FlZJkyZCCRiUD6CjlSt1NxpDlrIaimdJs9LP0FDcq9LOnNYVDz8quf6QmGT7QrFH"
    "OrDa9f2vEu9jPxh0+C4xh+zMeJmJWa7D9o0sfXt2Gd8ZaVq/SwCz/47usj2CG6aK3TgVhaR6Q3ru7Uf/cuf+bgh9V+tM4OwY"
    "tGCPgpoOHQFx2h68kaajaR2OdOzdnKPcqW6wXeuzw1HuxcNI5v2MbA171j/FmETSYXVS20+YMv7y+Y/xq/+KX/3w7L3SWK4w"
    "CYEc4YhS8ZhRKoI/PPn66tkzcfXHx1+9xjF+/ObVVfz46eOvXz5+GuIbNf0M0/jDkcYJvxMPy4rHTVGow/LWoMcZTEKdvYpE"
    "lWMHDZQzor0EdAVMPQsBbfGqjebmf7pUzvbC8txRi+fD95kI6p+qJqjxtANCTd6GZeeUZkPMbVXmnA5TSJmyd7mQmM9S4wUw"
    "4JtuCsc+ydcmjeVT/ZyHfdAI6vbkmFbpcfVPO3wQMOI5My2HQ3XprsYHKijf7YAchsVqjCOe1VNmEc2IrACKBFCCnTLpPlUR"
    "Akcy0BNdCoKzUxold3Lye3JpxOD4fqz15+HqOIH34dnq+rZz1Kwz/qfWkuyhdVflcUwkWxdC3J+TcjgVRVsCqZOOch4JT+vw"
    "Daj7SZ3erI275YyVUgcvzatFoiqPh7CDPlSGuY1/25tHHVvO7cjmDvtubTUDcHOQsBFWwqhnptTj5O33RPolHfNpoW6P0eOn"
    "2zyTOFFgMsBasCVwl7gqLIMZvNuu3X/H+nWFj6Uv/Cw6gwaKWoGDPpcy7qVW7D9Yl+g8JXhUgQDpGSc3y24B0O6vagPFeDM2"
    "ni8ulAtRNonz81LpO0iS88VlS4u4U0dQTiK0EoegIGzgNMqtUHiPU7lIbvFxiJJNAYV8TuI+riQge6epCkwOCS6AGugzFEt+"
    "KvVGNbgUN26DS2iAcl4/kfQjiveAjh6gAPXyjRHwNyH8pF+wcivszbXuRZzRK1UMOc7+hItTmsZ1madk49BDhQ6W+d1RUlMY"
    "pZjjeqsuQvPzwWjyKeqYzc7Mb6AUBRyNL0qoppk4RtSnlNdPz0bRq3ad925BO0AtRS3+qOH5SL0sfA894v+ttn9gq81FlMOE"
    "7seBOfzQA4G51jsAwWnwUR2e28N6IgJM/9qEeEeAmAXomLmstijuNmZ0Psgn6igbAJS8abUCw/ePLtNj673dDqztptPzows3"
    "LdgcfqE5kqMXGL6E7MNVEX4ewUfCjtJ9Yr41FJyccB5M7b3yaX36qKoUwH/wqUN0HXFjCurWgetXxoc1MZJKL+hc4KUrDA40"
    "w6yO3WClr5BWCZqb/40WyhWmGwXXD/6Co/3NZColroWCT5yr2048kUgsYZC/UMJp0LB7OPzbA73Udo7MR7qC3LnWE/Vd3In6"
    "b9BEB6/paCk+4tSnd8txszsGvPubQmzzZCG17esYvnhtgiW0I5Xr1lUy54F5en3fiGqzchbMasX84VzFMp/2YXAWPCO66Taa"
    "aa86y0C+Xah3XLsijyRlfYTcp06OUyfByT8nCiH6PquxCG3woD+TicMIg4+bmXBAek+CzmwOpSV0XpW454sSx1+TsMMfbZId"
    "e4vBpneooFyr6s4pcre8cooO5iUczEnQHOSIk/EINyGbtKeo/8T/w/IeEEbet3VsHMvKNZb0x0jd7Wdrst9d2cfYjrswraPS"
    "cZvRi0X1cd8Z/fGKPp8mRnlecPuRC5tcneyh/NOl4+98JH60zNn6I7GL45MUf8AXcl0nIv7FCWAl9B4SM2LeGeevGHxLMSB9"
    "ufNTyrz1XI1Jjq8r3eJfBDmlxwP1PWr9vpJ6wp3GqkNl7Jj9Beg635hH0e+cYgvnL78g39LuSbez+0CY/mMdh3n+sZO4j/h8"
    "oRcWxcA9hMF9knGPCwxOio1wi8YX8vSLd5Aearpj3uYPESXx+0qQu6MnfdLkqAjhLfA/72bXH0Xw0BoRh4a+/Kv8pjj8Bxde"
    "Nq1SEQSfan81trw7TI/04yLkJLbMd2SP/ZG6zw29vwBte9aOSE1ls/UWwuz+SYQmWcOdksujghWdTU5G34cJx3fz0/lWgKvr"
    "H3JbWZeVshYw58c1Gejdd3KfITHhrJd5OU9ys1T1emtwoSfBf/FIBb0E/T0wcxU7SzBIVVWSn7bF5wroaUWYMAX46O966QvR"
    "mLOIXkY7CtqIdcnLq9fZdqv+sFZSka8ZG9bqdQkaA6oTOnwAGv+WRaq20ATlUrDf9V+aWKxKjOFBB9YyQPa9fnKF+sjmiPXS"
    "ORJ7cmXcfMQLHH3CCmTUZxGTJwiu3/HPS/z5u99ZKRYRSsYX7yTNFHmM1X8j59SO7c9f2WY64OP/EKNJr7ddAIv9l7asUE91"
    "fH8nJ0gznYbsF+wr9US34wNUgMTJCZjj/35cgr2/SIoVz+PD522PPnwHc83t/THdxQZI/ieTeUovcdiukSIaUefAKSLmm2Ss"
    "0Ds8lI9MqrMbIjEJ1Fi9tmHCDqH6ycqVyiV2U9VU8rCTr+a/ZaZ93913zFo5ZU7EzunSeezMpq6Z9reEFsRKhInehIiAgETG"
    "nckvxDkJbVQ+Mo5xvD1pknR7fXsHHhqMxIfuL/LOHnGL7zHNb0nYHEqPb82Q3gxmGR16OxxH6n80NG63T6H9nOQ9lsKnYNTm"
    "Z5M9JSYHzqfGdW+6ln5F604PyaE9GbSsBc9S6FHvrFrXUuc8Na6lvnXVtgPpU1b3Hfc4McaH9K17EMAR1PQTgzFeOEH5PgaN"
    "5RP6gP3SVETJG8GSqYSufN3PdgGm0sm7rxVfaXtWiK/4luWkVuljIIywi5tAFr4PiZPzRUGm+EygHTCHif/wnyDsoXhPW2hr"
    "Cj8/wfdnA5hjgJL3Pem8jYVe4sasBIFBLhtmV4pDZAqUAvDrc0a1O4psODnhxCv1ExXclBW7s073S9tdV/iZDCetlKhUFiXG"
    "Wf1Omi4xwwGQBUoSk+g70zulSLSWdMaD9lH7/wLQNwjw"
)
path = "/tmp/old_triton_kernels_head.py"
with open(path, "wb") as f:
    f.write(zlib.decompress(base64.b64decode("".join(OLD))))
spec = importlib.util.spec_from_file_location("old_tk", path)
O = importlib.util.module_from_spec(spec); sys.modules["old_tk"] = O; spec.loader.exec_module(O)

SMALL = os.environ.get("PROF_SMALL") == "1"
dev = torch.device("cpu" if SMALL else "cuda")
if SMALL:
    torch.cuda.synchronize = lambda: None
SWEEP, CHECK = "--sweep" in sys.argv, "--check" in sys.argv

def t(fn, n=5):
    fn(); torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - s) / n * 1e3

def setcfg(mod, cfg):
    old = {k: getattr(mod, k) for k in cfg}
    for k, v in cfg.items(): setattr(mod, k, v)
    return old

for dist in ("uniform", "zipf"):
    rows = dlrm_rows(26, 1e5, 5e6, 1e-4 if SMALL else 1.0); B, L, D = (4, 3, 8) if SMALL else (16384, 80, 128)
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.randn(r, D, device=dev) * 0.01 for r in rows]
    n = B * L
    values = torch.cat([make_ids(r, n, dist, dev, gen) for r in rows])
    offsets = torch.arange(0, 26 * n + 1, L, device=dev)
    g = torch.randn(B, 26 * D, device=dev)
    dims = torch.tensor([D] * 26, dtype=torch.int32, device=dev); nr = torch.tensor(rows, device=dev)
    ent = torch.arange(26, dtype=torch.int32, device=dev); oc = torch.arange(26, device=dev) * D
    mt = torch.zeros(26, dtype=torch.bool, device=dev)
    args = (g, dims, nr, ent, oc, values, offsets, B, 26 * D, mt, None)
    keys = O._occurrences(dims, nr, ent, oc, values, offsets, B, 26 * D, mt, None)[0]
    u, c = torch.unique_consecutive(torch.sort(keys)[0], return_counts=True)
    print(dist, "unique rows", u.numel(), "max count", int(c.max()), "rows>32", int((c > 32).sum()), "rows>1024", int((c > 1024).sum()))
    del keys, u, c
    print(dist, "OLD bwd_rows", t(lambda: O.embedding_bag_bwd_rows(*args, max_dim=D)))
    print(dist, "NEW bwd_rows", t(lambda: K.embedding_bag_bwd_rows(*args, max_dim=D)), flush=True)
    if CHECK:
        a = O.embedding_bag_bwd_rows(*args, max_dim=D)
        b1 = K.embedding_bag_bwd_rows(*args, max_dim=D); b2 = K.embedding_bag_bwd_rows(*args, max_dim=D)
        for name in ("unique_keys", "row_table", "row_ids", "grad_offsets"):
            assert torch.equal(getattr(a, name), getattr(b1, name)), name
        err = (a.grad_rows - b1.grad_rows).abs().max().item(); scale = a.grad_rows.abs().max().item()
        print(dist, "check: max abs diff old/new", err, "max |g|", scale,
              "deterministic", all(torch.equal(x, y) for x, y in zip(b1, b2)))
        small = K.embedding_bag_bwd_rows(*args, max_dim=D, chunk_size=16)
        print(dist, "check chunk 16: max abs diff", (a.grad_rows - small.grad_rows).abs().max().item())
        del a, b1, b2, small
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU if SMALL else torch.profiler.ProfilerActivity.CUDA]) as prof:
        K.embedding_bag_bwd_rows(*args, max_dim=D); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total" if SMALL else "cuda_time_total", row_limit=8, max_name_column_width=60))
    rg = K.embedding_bag_bwd_rows(*args, max_dim=D)
    cnt = torch.bincount(rg.row_table.long(), minlength=26).tolist()
    per = list(zip(torch.split(rg.row_ids, cnt), torch.split(rg.grad_rows.view(-1, D), cnt)))
    st = [torch.zeros(w.shape[0], device=dev) for w in weights]
    def upd(mod):
        def f():
            for w, s, (i, gg) in zip(weights, st, per):
                a = dtrec.optim._triton_rows(w, i, gg)
                mod.rowwise_adagrad_update_rows(state=s, state_offsets=torch.zeros(1, dtype=torch.int64, device=dev),
                    lr=0.01, eps=1e-8, full_dims=a["dims"], **a)
        return f
    print(dist, "OLD update", t(upd(O)))
    print(dist, "NEW update", t(upd(K)))
    opt = dtrec.optim.RowWiseAdagrad(0.01); sts = [opt.init_state(w) for w in weights]
    def upd_opt():
        for w, s, (i, gg) in zip(weights, sts, per): opt.update_rows(w, s, i, gg)
    print(dist, "NEW update via optim", t(upd_opt))
    if CHECK:
        w0 = [w.clone() for w in weights]; s0 = [s.clone() for s in st]
        upd(O)(); wo = [w.clone() for w in weights]; so = [s.clone() for s in st]
        for w, a in zip(weights, w0): w.copy_(a)
        for s, a in zip(st, s0): s.copy_(a)
        upd(K)()
        print(dist, "check update: max w diff", max((a - b).abs().max().item() for a, b in zip(wo, weights)),
              "max s rel diff", max(((a - b).abs() / a.abs().clamp(min=1e-30)).max().item() for a, b in zip(so, st)))
    if SWEEP:
        base = dict(_BWD_TILE=2048, _BWD_WARPS=2, _BWD_BLOCK_L=16, _BWD_LONG_WARPS=4, _SEG_CHUNK=1024, _SHORT_SEG=16)
        variants = [dict(_BWD_TILE=1024, _BWD_WARPS=1), dict(_BWD_TILE=4096, _BWD_WARPS=4),
                    dict(_SHORT_SEG=32, _BWD_BLOCK_L=32)]
        for v in variants:
            cfg = {**base, **v}
            old = setcfg(K, cfg)
            try:
                print(dist, "sweep bwd", v, round(t(lambda: K.embedding_bag_bwd_rows(*args, max_dim=D)), 2), flush=True)
            except Exception as e:
                print(dist, "sweep bwd", v, "FAILED", repr(e)[:300])
            setcfg(K, old)
        for tile, warps in ((512, 1), (1024, 1), (2048, 2)):
                old = setcfg(K, dict(_ADAGRAD_TILE=tile, _ADAGRAD_WARPS=warps))
                try:
                    print(dist, "sweep update", tile, warps, round(t(upd(K)), 2))
                except Exception as e:
                    print(dist, "sweep update", tile, warps, "FAILED", repr(e)[:300])
                setcfg(K, old)
    del weights, values, g, rg, per, st, sts
    torch.cuda.empty_cache()
